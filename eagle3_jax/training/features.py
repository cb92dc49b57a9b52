"""Offline target features: run the frozen target once over the dataset and keep, per record, the
hidden states of every requested layer and the final hidden state on disk (float32 .npy memory maps).
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

from eagle3_jax.data.dataset import bucket_length
from eagle3_jax.errors import Eagle3Error

META = "features.json"


def precompute(
    target,
    ds,
    layers: tuple[int, ...],
    out_dir: str | Path,
    batch_size: int = 4,
    progress: bool = True,
    length_bucket: int = 64,
) -> Path:
    """Writes layer_{i}.npy [N, L, D] for each layer id and hidden.npy [N, L, D]; atomic per run."""
    from tqdm.auto import tqdm

    from eagle3_jax.training.step import target_features

    out = Path(out_dir)
    if (out / META).exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    n, t = ds.input_ids.shape
    d = target.cfg.hidden_size
    layers = tuple(sorted(set(target.cfg.check_aux_layer_ids(layers))))
    maps = {
        i: np.lib.format.open_memmap(tmp / f"layer_{i}.npy", "w+", np.float32, (n, t, d))
        for i in layers
    }
    hidden = np.lib.format.open_memmap(tmp / "hidden.npy", "w+", np.float32, (n, t, d))
    fn = jax.jit(target_features, static_argnames=("tcfg", "aux_ids"))
    # Shortest records first, each batch cut to its longest record rounded up to `length_bucket`:
    # the padding past a record's length is never read by training, so it is neither computed
    # nor written (those positions stay zero).
    by_len = np.argsort(ds.lengths, kind="stable")
    for lo in tqdm(range(0, n, batch_size), desc="features", disable=not progress):
        rows = by_len[lo : lo + batch_size]
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
        for k, i in enumerate(layers):
            maps[i][rows, :tl] = aux[..., k * d : (k + 1) * d]
        hidden[rows, :tl] = hid
    for m in (*maps.values(), hidden):
        m.flush()
    meta = {
        "layers": list(layers),
        "num_records": n,
        "max_len": t,
        "hidden_size": d,
        "input_ids_sum": int(ds.input_ids.astype(np.int64).sum()),
    }
    (tmp / META).write_text(json.dumps(meta))
    if out.exists():
        shutil.rmtree(out)
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

    def batch(self, rows: np.ndarray, length: int | None = None) -> dict[str, np.ndarray]:
        """Features of `rows`, cut to the first `length` positions (the batch's bucket)."""
        t = slice(None) if length is None else slice(0, length)
        return {
            "aux": np.concatenate([a[rows, t] for a in self.aux], axis=-1),
            "hidden": np.asarray(self.hidden[rows, t]),
        }
