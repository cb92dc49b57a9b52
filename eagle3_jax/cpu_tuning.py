"""How this machine should multiply a few rows on the CPU: a `ProductPolicy`, measured once.

XLA:CPU computes a product of a few rows (a tree verification's 2-8 tokens) with its GEMM, which
some CPUs handle poorly: there one vector-matrix product per row (`models.layers.dense`), and for
the tied output layer a row reduction over the embedding (`dense_t`), cost less; on others they
cost more (BENCHMARKS.md, "Which product is faster depends on the machine", "The output layer as
a row reduction"). So the entry points that decode on the CPU (decode.py, the evaluation harness,
data regeneration, the timing benchmarks) call `policy_for` once, before compiling anything, and
put its answer into the target's config (`dataclasses.replace(cfg, products=...)`); heads loaded
with `checkpoints.heads.load_head` take the target's. The models read only that static field:
library calls and training keep the default, plain products, and the same programs.

`policy_for` on the CPU: each choice is timed the first time on SmolLM2-shaped weights (both ways,
alternating, medians; the faster way only when 5 % faster), then cached per CPU model, CPU count
and jax version in <cache>/row_products.json and <cache>/logit_reduce.json (the cache folder:
`paths.cache_dir`), one stderr line each. EAGLE3_JAX_ROW_PRODUCTS / EAGLE3_JAX_LOGIT_REDUCE (a row
count; 0 = plain products always, 8 = the other way for 2-8 rows; unset or "auto": the probe)
skip the probe. Other backends get plain products.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.checkpoints.atomic import write_text_atomic
from eagle3_jax.config import PLAIN_PRODUCTS, ProductPolicy
from eagle3_jax.models.layers import dense, product_t, reduce_t
from eagle3_jax.paths import cache_dir, cpu_model

ROW_PRODUCTS_ENV = "EAGLE3_JAX_ROW_PRODUCTS"
ROW_PRODUCTS_ON = 8  # the most rows done one by one, when the probe picks row products
LOGIT_REDUCE_ENV = "EAGLE3_JAX_LOGIT_REDUCE"
LOGIT_REDUCE_ON = 8  # the most rows done as a row reduction, when the probe picks it


def limit_from_env(name: str) -> int | None:
    """A row limit set in the environment variable `name`, or None (unset or "auto": probed);
    anything else is an error."""
    value = os.environ.get(name, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if not value.isdigit():
        raise ValueError(f"{name}={value!r}: use auto or a row count (0 = plain products)")
    return int(value)


def median_ms_alternating(ways: dict[str, Callable], *args, reps: int) -> dict[str, float]:
    """Median ms of each of `ways` (jitted functions of `args`), warmed up, then timed in turn rep
    by rep so all see the same machine. Call outside any trace."""
    times: dict[str, list[float]] = {k: [] for k in ways}
    for fn in ways.values():
        jax.block_until_ready(fn(*args))
    for _ in range(reps):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {k: float(np.median(v)) for k, v in times.items()}


def time_row_products(rows: int = 4, layers: int = 6, reps: int = 25) -> dict[str, float]:
    """Median ms of `layers` SmolLM2-135M-shaped layers' projections (q, k, v, o, gate, up, down:
    576 wide, 1536 MLP, 192 K/V) over `rows` rows, through `dense` as row products and as
    plain products, timed alternately. The weights are arguments of the jitted functions, not
    constants baked into them. Call outside any trace."""
    d, f, kv = 576, 1536, 192
    rng = np.random.default_rng(0)
    shapes = ((d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d))
    first = [jnp.asarray(0.02 * rng.standard_normal(s, dtype=np.float32)) for s in shapes]
    # one random draw, `layers` distinct copies: the stack reads as many bytes as a real one
    ws = [[w + 0.0 for w in first] for _ in range(layers)]

    def stack(policy: ProductPolicy):
        def prod(x, w):
            return dense(x, w, policy=policy)

        def run(ws, x):
            for q, k, v, o, g, u, dn in ws:
                x = x + prod(prod(x, q), o) + prod(x, k).sum() + prod(x, v).sum()
                x = x + prod(jax.nn.silu(prod(x, g)) * prod(x, u), dn)
            return x

        return jax.jit(run)

    ways = {
        "row_products_ms": stack(ProductPolicy(row_products=rows)),
        "plain_products_ms": stack(PLAIN_PRODUCTS),
    }
    x = jnp.asarray(rng.standard_normal((rows, d), dtype=np.float32))
    return median_ms_alternating(ways, ws, x, reps=reps)


def time_logit_reduce(
    rows: int = 4, vocab: int = 49152, width: int = 576, reps: int = 15
) -> dict[str, float]:
    """Median ms of a SmolLM2-sized tied output layer ([vocab, width] fp32, a jit argument) over
    `rows` rows, as a row reduction and as a plain product, timed alternately. Call outside any
    trace."""
    rng = np.random.default_rng(0)
    w_t = jnp.asarray(0.02 * rng.standard_normal((vocab, width), dtype=np.float32))
    x = jnp.asarray(rng.standard_normal((rows, width), dtype=np.float32))
    ways = {"reduce_ms": jax.jit(reduce_t), "plain_products_ms": jax.jit(product_t)}
    return median_ms_alternating(ways, x, w_t, reps=reps)


def _probed_choice(
    file: str,
    timing: Callable[[], dict[str, float]],
    fast: str,
    on: int,
    what: str,
    report: Callable[[dict[str, Any], bool, Any], str],
) -> int:
    """`on` if timing()[fast] beats timing()["plain_products_ms"] by 5 % on this machine, else 0;
    measured once per CPU model, CPU count and jax version and cached in <cache>/<file>;
    `report(result, faster, path)` is the stderr line that says what was chosen, `what` names the
    probe if it fails (then plain products, not cached)."""
    path = cache_dir() / file
    key = f"{cpu_model()} | {os.cpu_count()} cpus | jax {jax.__version__}"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):  # not ours (or damaged): measure again and replace it
        known = {}
    if isinstance(known.get(key), dict) and "choice" in known[key]:
        return int(known[key]["choice"])
    try:
        result: dict[str, Any] = dict(timing())
    except Exception as e:  # noqa: BLE001 - reported, then the plain product
        print(f"eagle3_jax: {what} failed ({e!r}); plain products", file=sys.stderr)
        return 0
    faster = result[fast] < 0.95 * result["plain_products_ms"]
    result["choice"] = on if faster else 0
    known[key] = result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(known, indent=1) + "\n")
    except OSError:
        pass  # a read-only cache only costs the probe again next time
    print(report(result, faster, path), file=sys.stderr)
    return result["choice"]


@functools.cache
def choose_row_products() -> int:
    """The row-product limit for this machine: ROW_PRODUCTS_ON if row products beat plain products
    by 5 % at 4 rows here, else 0 (cached in <cache>/row_products.json, and in this process)."""
    return _probed_choice(
        "row_products.json",
        time_row_products,
        "row_products_ms",
        ROW_PRODUCTS_ON,
        "row-product probe",
        lambda r, faster, path: (
            f"eagle3_jax: {'row' if faster else 'plain'} products for 2-{ROW_PRODUCTS_ON} rows on "
            f"this CPU (4 rows: {r['row_products_ms']:.1f} ms row products, "
            f"{r['plain_products_ms']:.1f} ms plain; {ROW_PRODUCTS_ENV} overrides; cached in {path})"
        ),
    )


@functools.cache
def choose_logit_reduce() -> int:
    """LOGIT_REDUCE_ON if the row reduction beats the plain product by 5 % at 4 rows here, else 0
    (cached in <cache>/logit_reduce.json, and in this process)."""
    return _probed_choice(
        "logit_reduce.json",
        time_logit_reduce,
        "reduce_ms",
        LOGIT_REDUCE_ON,
        "output-layer probe",
        lambda r, faster, path: (
            f"eagle3_jax: output layer {'as a row reduction' if faster else 'as a plain product'} "
            f"for 2-{LOGIT_REDUCE_ON} rows on this CPU (4 rows: {r['reduce_ms']:.1f} ms reduction, "
            f"{r['plain_products_ms']:.1f} ms product; {LOGIT_REDUCE_ENV} overrides; cached in {path})"
        ),
    )


def row_products_max() -> int:
    """The most rows `dense` should multiply one by one on this CPU (0: none): the environment's
    setting, else the probe's."""
    limit = limit_from_env(ROW_PRODUCTS_ENV)
    return choose_row_products() if limit is None else limit


def logit_reduce_max() -> int:
    """The most rows `dense_t` should compute as a row reduction on this CPU (0: none): the
    environment's setting, else the probe's."""
    limit = limit_from_env(LOGIT_REDUCE_ENV)
    return choose_logit_reduce() if limit is None else limit


def policy_for(backend: str | None = None) -> ProductPolicy:
    """The product policy for `backend` (default: JAX's default backend): plain products off the
    CPU; on the CPU the environment's or the probes' choices (measured on first use, cached).
    Call it once at the start of an entry point, outside any trace."""
    if (backend or jax.default_backend()) != "cpu":
        return PLAIN_PRODUCTS
    return ProductPolicy(row_products=row_products_max(), logit_reduce=logit_reduce_max())
