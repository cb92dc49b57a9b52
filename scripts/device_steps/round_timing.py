"""The cost model's prediction beside a measurement: a plain decode step and one speculative round
timed on the device, each next to the cost model's prediction for it (`eagle3_jax.accelerators`;
issue 35 item 3).

The target has Llama-3.1-8B's shape (`accelerators.specs.target_config`) with RANDOM bf16 weights made on
the device (nothing is carried), the head sized like it with the output layer `--head` names
(EAGLE-3's 32,000 draft ids by default; the target's output embedding over all V; SpecVocab),
random too: the programs' work is fixed by their static shapes, not by the weights' values (but for
SpecVocab's, whose zero speculator makes a level's rows share their candidates, so that its
level takes the shared candidate gather as real text's levels do). Each program is the
one decoding runs (`plain.decode_step`, `speculative.round_step` with the eagle3 drafter, greedy),
at batch 1 and 8, on a static cache sized as `plan_shape` sizes it for `--prompt` + `--new`
tokens, with the cursor at `--prompt`: the state is made of zeros instead of by a prefill (a
round's time does not depend on what the cache holds, and a prefill would be one more compilation
per batch). Each program is compiled (`lower().compile()`, timed), called `--warmup` times, then
`--reps` times, each call waited for (`block_until_ready`); the median is reported with the 10th
and 90th percentiles.

Before each program the step estimates its compilation and its calls (`COMPILE_S`, scaled by
what the compilations so far took against their estimates: `Budget`) and skips it, naming what it
needed and what was left, when it would pass `--deadline-s` (counted from the end of the imports);
results.json is rewritten after every program, so a step stopped from outside still returns what
it measured; a program that fails (out of memory, say) is recorded under "failed" and the next
one runs. `--target tiny` is a 4-layer toy of the same structure, for the CPU test.

  python -m device_steps.round_timing --out DIR --deadline-s 240     (PYTHONPATH=.:scripts)

`device_steps.round_cost` runs it as a step of scripts/device_job.py and writes the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from device_steps.round_cost import TREE_NAMES, add_args, table
from eagle3_jax.accelerators import acceptance, predict, roofline, specs
from eagle3_jax.accelerators.programs import CHAIN_TREE
from eagle3_jax.config import PLAIN_PRODUCTS, DraftConfig, TargetConfig
from eagle3_jax.decoding import plain
from eagle3_jax.decoding import speculative as spec
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.decoding.tree import ACCELERATOR_TREE, TreeConfig
from eagle3_jax.models import draft as drf
from eagle3_jax.models import target as tgt
from eagle3_jax.models.draft_output import attach_target_head
from eagle3_jax.vocab import DraftVocab

# the trees by the names --trees takes (round_cost.TREE_NAMES)
TREES = {"10/8/60": ACCELERATOR_TREE, "chain": CHAIN_TREE}
assert tuple(TREES) == TREE_NAMES

# estimated seconds per program at a 32-layer target on a GPU, a little above what an H200 took
# on 2026-12-04 (jax 0.11.2, a cold compilation cache; benchmarks/results/round_cost_h200): the
# random weights 65-102 s at 7-8B (their initializer's compilation: 3-5 s once cached), the plain
# step 8-10 s, a round 13-34 s; the step rescales them by the first compilation it times (`Budget`)
COMPILE_S = {"init": 110.0, "plain": 15.0, "10/8/60": 40.0, "chain": 35.0}


def shapes(name: str, head: str = "eagle3") -> tuple[TargetConfig, DraftConfig]:
    """The target and head timed: a target of `accelerators.specs` (its published config.json
    sizes: `target_config` where the loaders' fields are kept, else `TARGETS`) or `tiny` (a
    4-layer toy with the same structure, for the CPU test; no EOS id, so every row keeps running),
    with the `head` of `accelerators.predict.vocab_method_heads` (the toy's: 64 draft ids, or all
    256 ids, SpecVocab at rank 8 with 32 candidates)."""
    if name == "tiny":
        base = specs.target_config("llama31_8b")
        tcfg = dataclasses.replace(
            base, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
            num_heads=4, num_kv_heads=2, head_dim=16, eos_token_ids=(),
        )  # fmt: skip
        return tcfg, predict.vocab_method_heads(tcfg, draft_vocab=64, candidates=32)[head]
    if name in specs.REAL_TARGETS:
        tcfg = specs.target_config(name)
    else:
        tcfg = dataclasses.replace(specs.TARGETS[name], products=PLAIN_PRODUCTS)
    return tcfg, predict.vocab_method_heads(tcfg)[head]


def _zeros(aval):
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        return jax.random.key(0)
    return jnp.zeros(aval.shape, aval.dtype)


@dataclasses.dataclass
class Inputs:
    """Random weights (made on the device) and the static sizes of one batch."""

    tparams: dict
    dparams: dict
    vocab: DraftVocab
    tcfg: TargetConfig
    dcfg: DraftConfig


def random_target(tcfg: TargetConfig, dtype=jnp.bfloat16) -> dict:
    init_t = jax.jit(functools.partial(tgt.init_params, tcfg, dtype=dtype))
    return jax.block_until_ready(init_t(jax.random.key(0)))


def random_inputs(
    tcfg: TargetConfig, dcfg: DraftConfig, dtype=jnp.bfloat16, tparams=None
) -> Inputs:
    """A head's random weights beside the target's (`tparams`, made here when None)."""
    if tparams is None:
        tparams = random_target(tcfg, dtype)
    init_d = jax.jit(functools.partial(drf.init_params, dcfg, dtype=dtype))
    dparams = attach_target_head(init_d(jax.random.key(1)), dcfg, tparams, tcfg)
    if dcfg.speculator_rank:
        # a zero speculator scores every id alike, so every row's candidates are the same ids
        # and a level takes the shared gather, as real text's levels do (siblings share most of
        # their candidates, draft_output.union_capacity); random weights would send most levels
        # to the per-row fallback. Its work (both products, the top-k) is the same either way.
        dparams = {**dparams, "spec_a": jnp.zeros_like(dparams["spec_a"])}
    vd, v = dcfg.draft_vocab_size, tcfg.vocab_size
    vocab = DraftVocab(jnp.zeros((vd,), jnp.int32), jnp.arange(v) < vd)  # the first Vd ids
    jax.block_until_ready(dparams)
    return Inputs(tparams, dparams, vocab, tcfg, dcfg)


def _full(b: int, v: int) -> jax.Array:
    """A fresh [B] int32 buffer (the state is donated: no two leaves may share one)."""
    return jnp.full((b,), v, jnp.int32)


def _prompt(b: int, t: int, p: int, limit: int):
    return (
        jnp.zeros((b, t), jnp.int32),
        jnp.full((b,), p, jnp.int32),
        jnp.full((b,), limit, jnp.int32),
        jax.random.key(0),
    )


def plain_program(x: Inputs, b: int, prompt: int, new: int):
    """(lowered decode_step, its fixed args, its state, shape): the cursor at `prompt`."""
    shape = plain.plan_shape([prompt] * b, new, prompt + new + 1)
    kw = dict(cfg=x.tcfg, shape=shape, sampling=Sampling(), eos_ids=x.tcfg.eos_token_ids)
    args = _prompt(b, shape.prompt_len, prompt, shape.max_new)
    avals = jax.eval_shape(functools.partial(plain.prefill, **kw), x.tparams, *args)
    limit = shape.max_new
    state = jax.tree.map(_zeros, avals)._replace(cursor=_full(b, prompt), limit=_full(b, limit))
    lowered = plain.decode_step.lower(x.tparams, state, **kw)
    return lowered, (x.tparams,), state, shape


def round_program(x: Inputs, b: int, prompt: int, new: int, tree: TreeConfig):
    """(lowered round_step, its fixed args, its state, shape): eagle3 drafter, greedy."""
    tree = tree.validate(x.dcfg.draft_vocab_size)
    extra = tree.round_slots + 1
    shape = plain.plan_shape([prompt] * b, new, prompt + new + extra + 1, extra)
    eos = x.tcfg.eos_token_ids
    kw = dict(tcfg=x.tcfg, dcfg=x.dcfg, shape=shape, tree=tree, sampling=Sampling(), eos_ids=eos)
    head = (x.tparams, x.dparams, x.tparams["embed"], x.vocab)
    args = _prompt(b, shape.prompt_len, prompt, shape.max_new)
    avals = jax.eval_shape(functools.partial(spec.prefill, **kw), *head, *args)
    state = dataclasses.replace(
        jax.tree.map(_zeros, avals),
        length=_full(b, prompt),
        pending_at=_full(b, prompt),
        limit=_full(b, shape.max_new),
        enc_n=_full(b, 1),
    )
    lowered = spec.round_step.lower(*head, state, **kw, method="eagle3")
    return lowered, head, state, shape


def time_calls(compiled, fixed: tuple, state, warmup: int, reps: int) -> tuple[list[float], object]:
    """(seconds of each of `reps` calls after `warmup`, each waited for; the last state): the
    state is donated and replaced by what the call returns, as in decoding."""
    for _ in range(warmup):
        state = compiled(*fixed, state)
    jax.block_until_ready(state)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        state = compiled(*fixed, state)
        jax.block_until_ready(state)
        out.append(time.perf_counter() - t0)
    return out, state


class Budget:
    """What is left before the deadline, and whether a program's estimated compile and calls fit.
    `COMPILE_S` is a guess for a 32-layer target; once a compilation is timed, estimates scale
    with the target's layers and by that compilation against its estimate, and are raised by any
    later one slower than its scaled estimate (a first program found in the compilation cache
    must not make the next, compiled afresh, look cheap)."""

    def __init__(self, deadline_s: float, t0: float):
        self.deadline, self.t0, self.scale = deadline_s, t0, None

    def left(self) -> float:
        return self.deadline - (time.monotonic() - self.t0)

    def need(self, what: str, calls: int, call_s: float, layers: int = 32) -> float:
        return self.estimate(what, layers) + calls * call_s + 5.0

    def estimate(self, what: str, layers: int = 32) -> float:
        if self.scale is None:  # nothing timed yet: the 32-layer guess, whatever the target
            return COMPILE_S[what]
        return COMPILE_S[what] * self.scale * layers / 32

    def learn(self, what: str, seconds: float, layers: int = 32) -> None:
        ratio = seconds / (COMPILE_S[what] * layers / 32)
        self.scale = max(ratio, 0.05) if self.scale is None else max(self.scale, ratio)


# instructions of an optimized HLO module that launch no kernel of their own
_NO_KERNEL = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
    "opt-barrier", "partition-id", "replica-id", "add-dependency",
}  # fmt: skip


def launches(hlo: str) -> dict:
    """A static count of the kernels one call of a compiled program launches, from its optimized
    HLO text (`compiled.as_text()`): every instruction of the entry computation but those in
    `_NO_KERNEL` (a fusion, a library call, a copy: one each), a while loop's body and condition
    times its known trip count (once, counted in "unknown_trips", where XLA left none), a
    conditional's dearest branch, a call's computation. What a per-kernel launch cost would
    add to the roofline's time is this count times that cost."""
    comps: dict[str, list[tuple[str, str]]] = {}
    cur, entry = None, None
    for line in hlo.split("\n"):
        head = re.match(r"(ENTRY )?%(\S+) \(.*\{$", line)
        if head:
            cur = head[2]
            comps[cur] = []
            entry = cur if head[1] else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            op = re.search(r"=\s.*?\s([a-z][a-z0-9-]*)\(", line)
            if op:
                comps[cur].append((op[1], line))
    unknown = [0]

    def named(line: str, key: str) -> list[str]:
        m = re.search(rf"{key}=\{{([^}}]*)\}}", line) or re.search(rf"{key}=(%[\w.-]+)", line)
        return [t.strip().lstrip("%") for t in m[1].split(",")] if m else []

    def count(name: str) -> int:
        n = 0
        for op, line in comps.get(name, []):
            if op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                unknown[0] += trips is None
                k = int(trips[1]) if trips else 1
                (body,), (cond,) = named(line, "body"), named(line, "condition")
                n += k * (count(body) + count(cond)) + count(cond)
            elif op == "conditional":
                branches = named(line, "branch_computations") or [
                    *named(line, "true_computation"),
                    *named(line, "false_computation"),
                ]
                n += max((count(b) for b in branches), default=0)
            elif op == "call":
                n += sum(count(c) for c in named(line, "to_apply"))
            elif op not in _NO_KERNEL:
                n += 1
        return n

    return {"kernels": count(entry) if entry else 0, "unknown_trips": unknown[0]}


def _stats(ts: list[float]) -> dict:
    a = np.asarray(ts) * 1e3
    return {
        "median_ms": float(np.median(a)),
        "p10_ms": float(np.percentile(a, 10)),
        "p90_ms": float(np.percentile(a, 90)),
        "reps": len(ts),
    }


def predict_device(name: str) -> specs.Device:
    """A `accelerators.specs.DEVICES` entry by its key in any case, spaces optional ("h200", "tpuv5e"),
    or "cpu" (`specs.CPU_2CORE`, an assumption, not a vendor figure)."""
    known = {k.lower().replace(" ", ""): v for k, v in specs.DEVICES.items()}
    known["cpu"] = specs.CPU_2CORE
    key = name.lower().replace(" ", "")
    if key not in known:
        raise SystemExit(f"--predict-device {name}: choose one of {', '.join(known)}")
    return known[key]


def predictions(tcfg, dcfg, device: str, b: int, context: int, tree: str | None) -> dict:
    """The cost model's time (ms) and cache slots on one chip of the plain step (`tree` None) or
    of one tree's round with this head, with τ from its acceptance model at EAGLE-3's Llama-3.1-8B
    τ (for the speedups)."""
    dev = predict_device(device)
    if tree is None:
        slots = roofline.slots_for(context)
        return {"ms": roofline.plain_step(tcfg, b, slots).time_s(dev, 1) * 1e3, "slots": slots}
    shape = TREES[tree]
    tau = acceptance.llama_acceptance().tau(shape)
    pr = predict.predict(dev, tcfg, shape, tau, b, context, dcfg=dcfg, chips=1)
    return {"ms": pr.round_s * 1e3, "slots": roofline.slots_for(context, shape), "tau": pr.tau}


def measure(args) -> dict:
    """Every target in turn (its random weights made once, every head's beside them); at each
    batch its plain step, then each tree's round with each head. What the deadline cannot hold
    is skipped and named."""
    t0 = time.monotonic()
    budget = Budget(args.deadline_s, t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trees = [t for t in args.trees.split(",") if t]
    heads = [h for h in args.head.split(",") if h]
    dev = jax.devices()[0]
    res: dict = {
        "target": args.target,
        "head": args.head,
        "dtype": "bfloat16",
        "device": dev.device_kind
        if dev.platform == dev.device_kind
        else f"{dev.platform} {dev.device_kind}",
        "jax": jax.__version__,
        "prompt": args.prompt,
        "context": args.prompt + args.new,
        "warmup": args.warmup,
        "reps": args.reps,
        "predicted_for": predict_device(args.predict_device).name,
        "batches": args.batches,
        "state": "zeros, no prefill",
        "rows": [],
        "ratios": [],
        "over_eagle3": [],
        "skipped": [],
        "failed": [],
        "init_s": {},
    }
    save = lambda: _write_json(out / "results.json", res)  # noqa: E731
    call_s = 0.05
    for target in [t for t in args.target.split(",") if t]:
        tcfg, _ = shapes(target)
        layers = tcfg.num_layers
        if budget.left() < budget.estimate("init", layers):
            line = f"{target}: the weights need ~{budget.estimate('init', layers):.0f} s, "
            res["skipped"].append(line + f"{budget.left():.0f} s left")
            print(f"skipped {res['skipped'][-1]}", flush=True)
            save()
            continue
        t = time.monotonic()
        tparams = random_target(tcfg)
        xs = {h: random_inputs(tcfg, shapes(target, h)[1], tparams=tparams) for h in heads}
        res["init_s"][target] = time.monotonic() - t
        for b in [int(v) for v in args.batches.split(",")]:
            plain_ms, rounds = None, {}
            for tree, head in [(None, None), *((tr, h) for tr in trees for h in heads)]:
                name = "plain" if tree is None else tree
                what = "plain step" if tree is None else f"round {tree_label(tree)}, {head} head"
                calls = args.warmup + args.reps
                need = budget.need(name, calls, call_s, layers)
                if need > budget.left():
                    line = (
                        f"{target} batch {b} {what}: needs ~{need:.0f} s (compile "
                        f"~{budget.estimate(name, layers):.0f} s, {calls} calls), "
                        f"{budget.left():.0f} s left"
                    )
                    res["skipped"].append(line)
                    print(f"skipped {line}", flush=True)
                    continue
                x = xs[head or heads[0]]
                t = time.monotonic()
                try:  # one program's failure (out of memory at batch 8, say) leaves the others
                    if tree is None:
                        lowered, fixed, state, shape = plain_program(x, b, args.prompt, args.new)
                    else:
                        lowered, fixed, state, shape = round_program(
                            x, b, args.prompt, args.new, TREES[tree]
                        )
                    compiled = lowered.compile()
                    compile_s = time.monotonic() - t
                    kernels = launches(compiled.as_text())
                    budget.learn(name, compile_s, layers)
                    stats = _stats(time_calls(compiled, fixed, state, args.warmup, args.reps)[0])
                except Exception as e:  # noqa: BLE001
                    res["failed"].append(f"{target} batch {b} {what}: {type(e).__name__}: "
                                         f"{str(e)[:300]}")  # fmt: skip
                    print(f"failed {res['failed'][-1]}", flush=True)
                    save()
                    continue
                call_s = max(call_s, stats["p90_ms"] / 1e3)
                p = predictions(tcfg, x.dcfg, args.predict_device, b, res["context"], tree)
                row = {
                    "target": target, "batch": b,
                    "program": "plain step" if tree is None else "round", "head": head,
                    "tree": None if tree is None else tree_label(tree), "slots": shape.slots,
                    "model_slots": p["slots"], "compile_s": compile_s, **stats, **kernels,
                    "predicted_ms": p["ms"],
                    "measured_over_predicted": stats["median_ms"] / p["ms"],
                }  # fmt: skip
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                if tree is None:
                    plain_ms, plain_pred = stats["median_ms"], p["ms"]
                else:
                    rounds[tree, head] = (stats["median_ms"], p["ms"])
                    if plain_ms is not None:
                        measured, predicted = stats["median_ms"] / plain_ms, p["ms"] / plain_pred
                        res["ratios"].append({
                            "target": target, "batch": b, "head": head, "tree": tree_label(tree),
                            "measured": measured, "predicted": predicted, "tau_model": p["tau"],
                            "speedup_measured": p["tau"] / measured,
                            "speedup_predicted": p["tau"] / predicted,
                        })  # fmt: skip
                    if head != "eagle3" and (tree, "eagle3") in rounds:
                        ref = rounds[tree, "eagle3"]
                        res["over_eagle3"].append({
                            "target": target, "batch": b, "head": head, "tree": tree_label(tree),
                            "measured": stats["median_ms"] / ref[0], "predicted": p["ms"] / ref[1],
                        })  # fmt: skip
                save()
                del state, compiled, lowered
        del xs, tparams
    res["wall_s"] = time.monotonic() - t0
    save()
    return res


def tree_label(name: str) -> str:
    """The name, and the shape (top_k/depth/total_tokens) where it differs: "chain 1/8/9"."""
    shape = predict.tree_text(TREES[name])
    return name if name == shape else f"{name} {shape}"


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_args(p)
    p.add_argument("--out", required=True)
    p.add_argument("--deadline-s", type=float, required=True, help="stop starting programs after")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    res = measure(args)
    (Path(args.out) / "report.md").write_text(table(res))
    print(table(res))
    # the last lines are what the step's log shows of this run
    print(
        f"{len(res['rows'])} programs timed, {len(res['skipped'])} skipped, "
        f"{len(res['failed'])} failed: {Path(args.out) / 'results.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
