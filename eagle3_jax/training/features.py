"""Offline target features: run the frozen target once over the dataset and keep, per record, the
hidden states of every requested layer and the final hidden state on disk (.npy memory maps, float32
or bfloat16: a pod-sized store in float32 runs to terabytes).
Any aux-layer set drawn from the stored layers can then train a head without the target in the loop,
which is what makes fusion-layer ablations cheap."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.checkpoints.atomic import MARKER, check_destination, written_by_us
from eagle3_jax.data.dataset import bucket_length
from eagle3_jax.errors import Eagle3Error, differing_keys
from eagle3_jax.training.step import target_features

META = "features.json"
PROGRESS = "progress.json"  # in the .partial directory: what is done, and for which inputs
DTYPES = ("float32", "bfloat16")  # bfloat16 is stored as its 16 bits (uint16 .npy) and read back


def inputs_of(target, ds, layers: tuple[int, ...], dtype: str) -> dict:
    """What decides a feature store's contents: the target (config and weights), the records and
    the layers; a store (finished or partial) is reused only when all of these match."""
    import hashlib

    h = hashlib.sha256()
    h.update(np.ascontiguousarray(ds.input_ids).tobytes())
    h.update(np.ascontiguousarray(ds.lengths).astype(np.int64).tobytes())
    return {
        "target": target_fingerprint(target),
        "records": h.hexdigest()[:16],
        "num_records": int(ds.input_ids.shape[0]),
        "max_len": int(ds.input_ids.shape[1]),
        "layers": list(layers),
        "dtype": dtype,
    }


def target_fingerprint(target) -> str:
    """A short hash of the target's config and every weight (a sample of each tensor's values,
    its shape and dtype): a store computed by another model is never reused."""
    import hashlib

    h = hashlib.sha256(repr(target.cfg).encode())
    for path, leaf in sorted(
        jax.tree_util.tree_flatten_with_path(target.params)[0], key=lambda kv: str(kv[0])
    ):
        a = np.asarray(jax.device_get(leaf)).reshape(-1)
        h.update(f"{path}{leaf.shape}{leaf.dtype}".encode())
        h.update(np.ascontiguousarray(a[:: max(1, a.size // 4096)]).astype(np.float32).tobytes())
    return h.hexdigest()[:16]


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
    """
    import time

    from tqdm.auto import tqdm

    if dtype not in DTYPES:
        raise Eagle3Error(f"feature dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    layers = tuple(sorted(set(target.cfg.check_aux_layer_ids(layers))))
    want = inputs_of(target, ds, layers, dtype)
    if (out / META).exists():
        meta = json.loads((out / META).read_text())
        if "inputs" in meta and meta["inputs"] != want:
            raise Eagle3Error(
                f"features in {out} were computed from other inputs ("
                f"{', '.join(differing_keys(meta['inputs'], want))} differ): point features_dir at "
                "a new directory"
            )
        return out
    check_destination(out, overwrite=False, what="features_dir")  # empty or absent
    tmp = out.with_name(out.name + ".partial")
    done = 0
    if tmp.exists():
        try:
            state = json.loads((tmp / PROGRESS).read_text())
        except (OSError, ValueError):
            state = None
        if state is not None and state.get("inputs") == want:
            done = int(state["done_batches"])
        elif written_by_us(tmp):
            shutil.rmtree(tmp)  # a store of other inputs, ours: start again
        else:
            check_destination(tmp, what="features_dir's .partial sibling")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / MARKER).write_text("written by eagle3_jax; replaced only by it\n")
    n, t = ds.input_ids.shape
    d = target.cfg.hidden_size
    store = np.float32 if dtype == "float32" else np.uint16
    mode = "r+" if done else "w+"
    maps = {
        i: np.lib.format.open_memmap(tmp / f"layer_{i}.npy", mode, store, (n, t, d)) for i in layers
    }
    hidden = np.lib.format.open_memmap(tmp / "hidden.npy", mode, store, (n, t, d))

    def stored(x):
        x = np.asarray(x, np.float32)
        if dtype == "float32":
            return x
        return np.asarray(jnp.asarray(x, jnp.bfloat16)).view(np.uint16)

    def checkpoint(k: int) -> None:
        for m in (*maps.values(), hidden):
            m.flush()
        state = {"inputs": want, "done_batches": k}
        (tmp / (PROGRESS + ".tmp")).write_text(json.dumps(state))
        os.replace(tmp / (PROGRESS + ".tmp"), tmp / PROGRESS)

    fn = jax.jit(target_features, static_argnames=("tcfg", "aux_ids"))
    # Shortest records first, each batch cut to its longest record rounded up to `length_bucket`:
    # the padding past a record's length is never read by training, so it is neither computed
    # nor written (those positions stay zero).
    by_len = np.argsort(ds.lengths, kind="stable")
    starts = range(0, n, batch_size)
    last = time.monotonic()
    for k in tqdm(range(done, len(starts)), desc="features", disable=not progress, initial=done,
                  total=len(starts)):  # fmt: skip
        rows = by_len[starts[k] : starts[k] + batch_size]
        pad = np.resize(rows, batch_size)  # one batch size for every batch
        tl = bucket_length(ds.lengths[rows].max(), length_bucket, t)
        mask = (np.arange(tl)[None, :] < ds.lengths[pad][:, None]).astype(np.int32)
        aux, hid = fn(
            target.params,
            jnp.asarray(ds.input_ids[pad, :tl]),
            jnp.asarray(mask),
            tcfg=target.cfg,
            aux_ids=layers,
        )
        aux, hid = np.asarray(aux)[: len(rows)], np.asarray(hid)[: len(rows)]
        for j, i in enumerate(layers):
            maps[i][rows, :tl] = stored(aux[..., j * d : (j + 1) * d])
        hidden[rows, :tl] = stored(hid)
        if time.monotonic() - last > checkpoint_seconds:
            checkpoint(k + 1)
            last = time.monotonic()
    checkpoint(len(starts))
    meta = {
        "layers": list(layers),
        "num_records": n,
        "max_len": t,
        "hidden_size": d,
        "dtype": dtype,
        "input_ids_sum": int(ds.input_ids.astype(np.int64).sum()),
        "inputs": want,
    }
    (tmp / META).write_text(json.dumps(meta))
    (tmp / PROGRESS).unlink()
    if out.exists():
        out.rmdir()  # empty: check_destination allowed nothing else
    os.replace(tmp, out)
    return out


class OfflineFeatures:
    """Reads the aux features of a given layer set (concatenated in that order) and the hidden state."""

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
        self.aux = [np.load(path / f"layer_{i}.npy", mmap_mode="r") for i in aux_ids]
        self.hidden = np.load(path / "hidden.npy", mmap_mode="r")
        self.bf16 = meta.get("dtype", "float32") == "bfloat16"

    def batch(self, rows: np.ndarray, length: int | None = None) -> dict[str, np.ndarray]:
        """Features of `rows`, cut to the first `length` positions (the batch's bucket)."""
        t = slice(None) if length is None else slice(0, length)

        def read(a):
            x = np.asarray(a[rows, t])
            if self.bf16:  # the stored 16 bits are a bfloat16's: widen exactly to float32
                x = (x.astype(np.uint32) << 16).view(np.float32)
            return x

        return {
            "aux": np.concatenate([read(a) for a in self.aux], axis=-1),
            "hidden": read(self.hidden),
        }
