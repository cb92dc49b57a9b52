"""Offline target features: run the frozen target once over the dataset and keep, per record, the
hidden states of every requested layer and the final hidden state on disk (.npy memory maps, float32
or bfloat16: a pod-sized store in float32 runs to terabytes).
Any aux-layer set drawn from the stored layers can then train a head without the target in the loop,
which is what makes fusion-layer ablations cheap."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import distributed
from eagle3_jax.backends import routed_as_wanted
from eagle3_jax.checkpoints import target_digest
from eagle3_jax.checkpoints.atomic import (
    MARKER,
    check_destination,
    write_text_atomic,
    written_by_us,
)
from eagle3_jax.data.dataset import bucket_length
from eagle3_jax.errors import Eagle3Error, differing_keys
from eagle3_jax.sharding import mesh_of
from eagle3_jax.training.step import target_features

META = "features.json"
PROGRESS = "progress.json"  # in the .partial directory: what is done, and for which inputs
DTYPES = ("float32", "bfloat16")  # bfloat16 is stored as its 16 bits (uint16 .npy) and read back


def inputs_of(target, ds, layers: tuple[int, ...], dtype: str) -> dict:
    """What decides a feature store's contents: the target (its files' `target_digest`, the one
    fingerprint of a target every reuse check uses), the records and the layers; a store
    (finished or partial) is reused only when all of these match."""
    import hashlib

    h = hashlib.sha256()
    h.update(np.ascontiguousarray(ds.input_ids).tobytes())
    h.update(np.ascontiguousarray(ds.lengths).astype(np.int64).tobytes())
    return {
        "target": target_digest(target.path),
        "records": h.hexdigest()[:16],
        "num_records": int(ds.input_ids.shape[0]),
        "max_len": int(ds.input_ids.shape[1]),
        "layers": list(layers),
        "dtype": dtype,
    }


def legacy_target_fingerprint(target) -> str | None:
    """The target fingerprint that stores written before `target_digest` recorded (a hash of the
    config's repr and a sample of every weight's values, shape and dtype), kept only to recognise
    those stores; None where a weight is not addressable from this process (a target spread over
    several hosts), which cannot be fetched whole here."""
    import hashlib

    leaves = jax.tree_util.tree_flatten_with_path(target.params)[0]
    if not all(getattr(x, "is_fully_addressable", True) for _, x in leaves):
        return None
    h = hashlib.sha256(repr(target.cfg).encode())
    for path, leaf in sorted(leaves, key=lambda kv: str(kv[0])):
        a = np.asarray(jax.device_get(leaf)).reshape(-1)
        h.update(f"{path}{leaf.shape}{leaf.dtype}".encode())
        h.update(np.ascontiguousarray(a[:: max(1, a.size // 4096)]).astype(np.float32).tobytes())
    return h.hexdigest()[:16]


def same_inputs(have: dict | None, want: dict, legacy) -> bool:
    """Whether a store recorded as made from `have` is one of `want`. A store written before the
    target was named by `target_digest` recorded `legacy_target_fingerprint` instead: it matches
    when every other input is equal and that fingerprint (`legacy()`, computed only then) is the
    recorded one: the same config and weights."""
    if have == want:
        return True
    if not isinstance(have, dict) or differing_keys(have, want) != ["target"]:
        return False
    return legacy() == have["target"]


def _migrate(out: Path, meta: dict, want: dict) -> None:
    """Records `want` (the target's digest) in a finished store that matched by its legacy
    fingerprint, keeping that one beside it, so the weights are not hashed on every later run.
    Written whole and renamed: a reader sees the old file or the new one."""
    meta = {**meta, "inputs": want, "legacy_target_fingerprint": meta["inputs"]["target"]}
    write_text_atomic(out / META, json.dumps(meta))


def _partial(out: Path) -> Path:
    """Where the store at `out` is built before it is renamed into place."""
    return out.with_name(out.name + ".partial")


def build_progress(out_dir: str | Path) -> tuple[int, int | None] | None:
    """How far a store being built at `out_dir` has come, read from its files alone: (batches
    done, their total, None where a progress file from before totals were kept leaves it
    unknown) over every process's progress file, a file being replaced skipped; None when no
    partial store is there."""
    tmp = _partial(Path(out_dir))
    if not tmp.is_dir():
        return None
    states = [_read_progress(f) for f in [tmp / PROGRESS, *sorted(tmp.glob(f"shard*/{PROGRESS}"))]]
    states = [st for st in states if st is not None]
    totals = [st.get("total_batches") for st in states]
    total = sum(totals) if totals and None not in totals else None
    return sum(int(st.get("done_batches", 0)) for st in states), total


def _progress_path(tmp: Path, count: int, me: int) -> Path:
    return tmp / PROGRESS if count == 1 else tmp / f"shard{me}" / PROGRESS


def precompute(
    target,
    ds,
    layers: tuple[int, ...],
    out_dir: str | Path,
    batch_size: int = 4,
    progress: bool = True,
    length_bucket: int = 64,
    dtype: str = "float32",
    checkpoint_seconds: float = 60.0,
) -> Path:
    """Writes layer_{i}.npy [N, L, D] for each layer id and hidden.npy [N, L, D].

    Built in `OUT.partial` and renamed to OUT when complete. Resumable: every
    `checkpoint_seconds` the maps are flushed and `progress.json` records how many batches are
    done, so a killed run continues from there (after checking that the target, records, layers
    and dtype are the same; otherwise it refuses, naming what differs). A finished store is
    reused only on the same inputs. Never removes a directory it did not write.

    Called by every process of a multi-process run together (`distributed.share`), the batches
    are dealt out in turn (process p computes batches p, p + P, ... of the one-process plan, each
    with the target on its own devices) and each process writes its rows to `shard{p}/` (the
    same files plus rows.npy, the records' indices); process 0 writes features.json, naming the
    shards, once every process is done. `OfflineFeatures` reads either layout; the arrays are
    the one-process run's, bit for bit (the same batches, so the same computation).
    """
    from tqdm.auto import tqdm

    if dtype not in DTYPES:
        raise Eagle3Error(f"feature dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    layers = tuple(sorted(set(target.cfg.check_aux_layer_ids(layers))))
    want = inputs_of(target, ds, layers, dtype)
    count, me = distributed.share()
    legacy = functools.cache(lambda: legacy_target_fingerprint(target))
    if _finished(out, want, legacy):
        return out
    check_destination(out, overwrite=False, what="features_dir")  # empty or absent
    tmp = _partial(out)
    with distributed.primary_first("features: start") if count > 1 else contextlib.nullcontext():
        if me == 0:  # process 0 keeps a partial store of these inputs, or clears one of ours
            _start_partial(tmp, want, legacy, count)
    state = _read_progress(_progress_path(tmp, count, me))
    # resumed only over the same batches (older progress files did not record their size)
    ok = (
        state is not None
        and state.get("batch_size", batch_size) == batch_size
        and same_inputs(state.get("inputs"), want, legacy)
    )
    done = int(state.get("done_batches", 0)) if ok else 0
    plan = _Plan.of(ds, batch_size, count, me)
    shard = (count, me)
    store = _Store(tmp, shard, plan, layers, target.cfg.hidden_size, ds.input_ids.shape[1], dtype,
                   done)  # fmt: skip
    store.progress = {"inputs": want, "processes": count, "batch_size": batch_size,
                      "total_batches": len(plan.starts)}  # fmt: skip
    fn = jax.jit(target_features, static_argnames=("tcfg", "aux_ids"))
    # a routed target's experts dispatched as this backend runs them (training's own forward)
    tcfg = routed_as_wanted(target.cfg, mesh=mesh_of(target.params))
    last = time.monotonic()
    desc = "features" if count == 1 else f"features (process 0's share of {count})"
    try:
        for k in tqdm(range(done, len(plan.starts)), desc=desc, disable=not progress or me != 0,
                      initial=done, total=len(plan.starts)):  # fmt: skip
            rows = plan.rows(k, batch_size)
            pad = np.resize(rows, batch_size)  # one batch size for every batch
            tl = bucket_length(ds.lengths[rows].max(), length_bucket, ds.input_ids.shape[1])
            mask = (np.arange(tl)[None, :] < ds.lengths[pad][:, None]).astype(np.int32)
            aux, hid = fn(target.params, jnp.asarray(ds.input_ids[pad, :tl]), jnp.asarray(mask),
                          tcfg=tcfg, aux_ids=layers)  # fmt: skip
            store.write(
                plan.at(rows), tl, np.asarray(aux)[: len(rows)], np.asarray(hid)[: len(rows)]
            )
            if time.monotonic() - last > checkpoint_seconds:
                store.checkpoint(k + 1)
                last = time.monotonic()
        store.checkpoint(len(plan.starts))
    except BaseException as e:
        if count > 1:  # the others finish their shares, then stop naming this process
            distributed.all_gather("features: computed", distributed.failure(e), wait=False)
        raise
    if count > 1:
        distributed.check_gathered(distributed.all_gather("features: computed", plan.size))
    _finish(out, tmp, ds, layers, target.cfg.hidden_size, dtype, want)
    return out


def _finished(out: Path, want: dict, legacy) -> bool:
    """Whether `out` holds a finished store of these inputs (an older record of the same inputs
    is brought up to date); one of other inputs is refused, naming what differs."""
    if not (out / META).exists():
        return False
    meta = json.loads((out / META).read_text())
    if "inputs" in meta and meta["inputs"] != want:
        if not same_inputs(meta["inputs"], want, legacy):
            raise Eagle3Error(
                f"features in {out} were computed from other inputs ("
                f"{', '.join(differing_keys(meta['inputs'], want))} differ): point "
                "features_dir at a new directory"
            )
        if jax.process_index() == 0:
            _migrate(out, meta, want)
    return True


@dataclasses.dataclass
class _Plan:
    """This process's batches: records shortest first, batch k of the one-process plan is
    by_len[starts[k]:...]; with several processes each takes every P-th batch and stores its
    rows densely (`rows_of`: record -> row of its shard)."""

    by_len: np.ndarray
    starts: range
    rows_of: dict | None  # None: one process, row r of the store is record r
    size: int

    @classmethod
    def of(cls, ds, batch_size: int, count: int, me: int) -> _Plan:
        n = ds.input_ids.shape[0]
        # Shortest records first, each batch cut to its longest record rounded up to
        # `length_bucket`: the padding past a record's length is never read by training, so it
        # is neither computed nor written (those positions stay zero).
        by_len = np.argsort(ds.lengths, kind="stable")
        starts = range(0, n, batch_size)[me::count]  # this process's batches
        if count == 1:
            return cls(by_len, starts, None, n)
        mine = np.concatenate([by_len[s : s + batch_size] for s in starts] or [np.zeros(0, int)])
        return cls(by_len, starts, {int(r): j for j, r in enumerate(mine)}, len(mine))

    def rows(self, k: int, batch_size: int) -> np.ndarray:
        return self.by_len[self.starts[k] : self.starts[k] + batch_size]

    def at(self, rows: np.ndarray) -> np.ndarray:
        return rows if self.rows_of is None else np.array([self.rows_of[int(r)] for r in rows])


class _Store:
    """The memory maps one process writes (layer_{i}.npy and hidden.npy, in `tmp` or its shard)
    and its progress file."""

    def __init__(self, tmp: Path, shard: tuple[int, int], plan: _Plan, layers, d: int, t: int,
                 dtype: str, done: int):  # fmt: skip
        self.tmp, self.layers, self.d, self.dtype = tmp, layers, d, dtype
        self.shard = shard  # (processes, this one)
        single = plan.rows_of is None
        self.home = tmp if single else tmp / f"shard{shard[1]}"
        self.home.mkdir(parents=True, exist_ok=True)
        if not single and not done:
            np.save(self.home / "rows.npy", np.fromiter(plan.rows_of, np.int64, plan.size))
        store = np.float32 if dtype == "float32" else np.uint16
        mode = "r+" if done else "w+"
        # a memmap cannot be empty: a process without a batch (more processes than batches)
        # keeps one
        shape = (plan.size if single else max(plan.size, 1), t, d)
        self.maps = {
            i: np.lib.format.open_memmap(self.home / f"layer_{i}.npy", mode, store, shape)
            for i in layers
        }
        self.hidden = np.lib.format.open_memmap(self.home / "hidden.npy", mode, store, shape)
        self.progress: dict = {}

    def _stored(self, x):
        x = np.asarray(x, np.float32)
        if self.dtype == "float32":
            return x
        return np.asarray(jnp.asarray(x, jnp.bfloat16)).view(np.uint16)

    def write(self, at: np.ndarray, tl: int, aux: np.ndarray, hid: np.ndarray) -> None:
        d = self.d
        for j, i in enumerate(self.layers):
            self.maps[i][at, :tl] = self._stored(aux[..., j * d : (j + 1) * d])
        self.hidden[at, :tl] = self._stored(hid)

    def checkpoint(self, k: int) -> None:
        for m in (*self.maps.values(), self.hidden):
            m.flush()
        state = {**self.progress, "done_batches": k}
        path = _progress_path(self.tmp, *self.shard)
        (path.parent / (PROGRESS + ".tmp")).write_text(json.dumps(state))
        os.replace(path.parent / (PROGRESS + ".tmp"), path)


def _finish(out: Path, tmp: Path, ds, layers, d: int, dtype: str, want: dict) -> None:
    """Process 0 writes features.json (naming the shards) once every process is done, and
    renames the partial store to `out`."""
    count, me = distributed.share()
    n, t = ds.input_ids.shape
    meta = {
        "layers": list(layers),
        "num_records": n,
        "max_len": t,
        "hidden_size": d,
        "dtype": dtype,
        "input_ids_sum": int(ds.input_ids.astype(np.int64).sum()),
        "inputs": want,
    }
    if count > 1:
        meta["shards"] = [f"shard{p}" for p in range(count)]
    with distributed.primary_first("features: done") if count > 1 else contextlib.nullcontext():
        if me == 0:
            (tmp / META).write_text(json.dumps(meta))
            for path in [tmp / PROGRESS, *tmp.glob(f"shard*/{PROGRESS}")]:
                path.unlink(missing_ok=True)
            if out.exists():
                out.rmdir()  # empty: check_destination allowed nothing else
            os.replace(tmp, out)


def _read_progress(path: Path) -> dict | None:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _start_partial(tmp: Path, want: dict, legacy, count: int) -> None:
    """Keeps `tmp` (a partial store) when it was begun on the same inputs by as many processes
    (a store from before multi-process precompute recorded no count: one); clears it when it is
    ours but of other inputs or another count; refuses anything else there."""
    if tmp.exists():
        state = _read_progress(tmp / PROGRESS)
        keep = (
            state is not None
            and state.get("processes", 1) == count
            and same_inputs(state.get("inputs"), want, legacy)
        )
        if not keep and written_by_us(tmp):
            shutil.rmtree(tmp)  # a store of other inputs, ours: start again
        elif not keep:
            check_destination(tmp, what="features_dir's .partial sibling")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / MARKER).write_text("written by eagle3_jax; replaced only by it\n")
    if count > 1 and not (tmp / PROGRESS).exists():  # what the shards were begun for
        (tmp / PROGRESS).write_text(json.dumps({"inputs": want, "processes": count}))


class OfflineFeatures:
    """Reads the aux features of a given layer set (concatenated in that order) and the hidden
    state, from a one-process store or the shards of a multi-process one."""

    def __init__(self, path: str | Path, ds, aux_ids: tuple[int, ...]):
        path = Path(path)
        try:
            meta = json.loads((path / META).read_text())
        except (OSError, ValueError):
            raise Eagle3Error(
                f"no precomputed features in {path}: run train.py --precompute-features "
                "with the same config first"
            ) from None
        if meta["num_records"] != ds.num_records or meta["input_ids_sum"] != int(
            ds.input_ids.astype(np.int64).sum()
        ):
            raise Eagle3Error(
                f"features in {path} were computed for another dataset: precompute again"
            )
        missing = [i for i in aux_ids if i not in meta["layers"]]
        if missing:
            raise Eagle3Error(
                f"features in {path} hold layers {meta['layers']}, not {missing}: "
                "precompute with feature_layers covering every aux id"
            )
        self.bf16 = meta.get("dtype", "float32") == "bfloat16"
        # one part per shard: (its records' indices, or None for all in order; aux maps; hidden)
        self.parts = []
        for home in [path / s for s in meta.get("shards", ())] or [path]:
            rows = np.load(home / "rows.npy") if home != path else None
            aux = [np.load(home / f"layer_{i}.npy", mmap_mode="r") for i in aux_ids]
            self.parts.append((rows, aux, np.load(home / "hidden.npy", mmap_mode="r")))
        n = meta["num_records"]
        if self.parts[0][0] is not None:  # record -> (shard, row in it)
            self.shard_of, self.row_in = np.full(n, -1), np.full(n, -1)
            for k, (rows, _, _) in enumerate(self.parts):
                self.shard_of[rows], self.row_in[rows] = k, np.arange(len(rows))
            if (self.shard_of < 0).any():
                raise Eagle3Error(
                    f"features in {path}: the shards lack some records; precompute again"
                )

    def _read(self, a, rows, t) -> np.ndarray:
        x = np.asarray(a[rows, t])
        if self.bf16:  # the stored 16 bits are a bfloat16's: widen exactly to float32
            x = (x.astype(np.uint32) << 16).view(np.float32)
        return x

    def batch(self, rows: np.ndarray, length: int | None = None) -> dict[str, np.ndarray]:
        """Features of `rows`, cut to the first `length` positions (the batch's bucket)."""
        t = slice(None) if length is None else slice(0, length)
        rows = np.asarray(rows)
        if self.parts[0][0] is None:
            _, aux, hidden = self.parts[0]
            return {
                "aux": np.concatenate([self._read(a, rows, t) for a in aux], axis=-1),
                "hidden": self._read(hidden, rows, t),
            }
        out = None
        for k, (_, aux, hidden) in enumerate(self.parts):
            here = np.flatnonzero(self.shard_of[rows] == k)
            if not len(here):
                continue
            local = self.row_in[rows[here]]
            got = {
                "aux": np.concatenate([self._read(a, local, t) for a in aux], axis=-1),
                "hidden": self._read(hidden, local, t),
            }
            if out is None:
                out = {n: np.zeros((len(rows), *v.shape[1:]), v.dtype) for n, v in got.items()}
            for n, v in got.items():
                out[n][here] = v
        return out
