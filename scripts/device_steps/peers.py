"""The `peers` step: our plain decoding beside transformers' on the same chip in the same run
(issue 58 item 4c, its first half). One call of at most ~6 minutes on a lent GPU, random weights
made on the device, nothing carried.

Two phases, each a subprocess (`python -m device_steps.peers PHASE`) with a deadline, each
writing its JSON after every batch, and `summary.json` with `report.md` rewritten after each
phase, so a call cut off early still returns what was measured:

  ours    plain greedy decoding with the engine as decoding runs it on this backend: random
          weights at --target's shape (`gpu_speed.shapes` and `gpu_speed.random_weights`;
          bf16 on a GPU, fp32 on the CPU: `--dtype auto`), laid out by
          `backends.prepare_target` (on a GPU: q/k/v and gate/up fused, the attention
          `backends.attention_wanted` picks, the Pallas flash-decoding kernel for bf16), XLA's
          flags from `backends.set_xla_flags` (command buffers); `plain.generate` (the jitted
          prefill and `decode_loop`, a `lax.while_loop` of `decode_step`) with EOS disabled, so
          every row makes exactly --new tokens; its first call compiles (`warmup=True`, a
          one-token run), then --reps calls are timed -> ours.json
  theirs  transformers' model of the family (`AutoModelForCausalLM.from_config`, the same
          config.json fields as `accelerators.specs.REAL_TARGETS`, the toy's sizes for tiny),
          its own random init, on CUDA in the same dtype (fp32 on the CPU for the toy), greedy
          `generate(do_sample=False, cache_implementation="static", max_new_tokens=N)` of the
          same prompts with `torch.compile(mode="reduce-overhead", fullgraph=True)` -> theirs.json

The torch.compile recipe follows the installed transformers: where it has `CompileConfig`
(4.47 and later; the venv's 5.24), `generate(..., compile_config=CompileConfig(fullgraph=True,
mode="reduce-overhead"))`, which compiles the decoding forward once and leaves the prefill eager
(compiling `model.forward` by hand there would compile it a second time, and the prefill's other
shape would turn the decode graph into a dynamic-shape one); before that, the docs' older recipe,
`model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`. Each
engine is warmed up (compiled; CUDA graphs recorded) before it is timed, and the compilation
is checked, not assumed: dynamo's count of compiled graphs. Should the compilation fail (no C++
compiler for inductor, say), the phase times eager torch instead and records `"compiled": false`
with the error. Where torch or transformers is missing, or torch has no CUDA on a GPU machine,
theirs.json says `{"available": false, "why": ...}` and the step still succeeds.

Both time the whole `generate` (prefill + N new tokens; transformers' per-step host loop is part
of its cost), tokens/s = batch x N / wall seconds, the median of --reps. dynamo is reset between
batches, so that each batch is compiled for static shapes.

Everything lands in OUT/peers/: summary.json (`{"device", "target", "batch", "prompt", "new",
"ours_tok_s", "transformers_compile_tok_s", "ratio", "torch", "transformers", "compiled",
"rows": [{"batch", "ours_tok_s", "transformers_compile_tok_s", "ratio"}], ...}`: the headline is
the first batch, `ratio` ours over theirs; it goes into gpu_speed's summary.json as
`"peers": {"transformers_compile": ratio}`), report.md, ours.json, theirs.json, the phases' logs
and device_log.txt. `--target tiny` runs the whole step on a CPU.

This module imports no jax and no torch at import time: the step's own process leaves the GPU's
memory to the phases' subprocesses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from device_steps import common as c
from device_steps import gpu_speed as gs

PHASES = ("ours", "theirs")
# each phase's share of what is left when it starts (ours' unused time goes to theirs, whose
# torch.compile of an 8B model takes the longest)
SHARES = {"ours": 0.4, "theirs": 0.6}
# targets transformers can build: the config.json fields `accelerators.specs` keeps, and the toy
TARGETS = ("llama31_8b", "olmo2_7b", "qwen3_4b", "tiny")
RESERVE_S = 15.0
# a batch after the first is started only when what the last one took, times this, is left
NEXT_BATCH_MARGIN = 1.3
TORCH_DTYPES = {"bfloat16": "bfloat16", "float32": "float32"}
COMPILE_OPTIONS = {"fullgraph": True, "mode": "reduce-overhead"}

# (flag, type, default, help): the measurement's flags, taken by the step and by both phases
FLAGS = (
    ("--target", gs._names(TARGETS), "llama31_8b", "the shape (tiny: a CPU toy)"),
    ("--batches", gs._ints, "1,8", "batch sizes in order; the first is the headline"),
    ("--prompt", int, 1024, "prompt tokens (random ids, the same for both engines)"),
    ("--new", int, 256, "new tokens a row (EOS disabled)"),
    ("--reps", int, 3, "timed generate calls a batch and engine, after the warm-up"),
    ("--dtype", gs._names(("auto", "bfloat16", "float32")), "auto",
     "both engines' weights: auto is bfloat16 on a GPU, float32 on the CPU"),
)  # fmt: skip


def add_args(p: argparse.ArgumentParser, step: bool = False) -> None:
    """The measurement's flags (`FLAGS`), and with `step` the step's own."""
    gs.add_flags(p, FLAGS, step, 6.0, "peers", PHASES)


def forward(args: argparse.Namespace) -> list[str]:
    """The flags of `FLAGS` as command-line words, with the values `args` holds."""
    return gs.forward(args, FLAGS)


def hf_config(name: str) -> dict:
    """transformers' config.json fields for --target: `specs.REAL_TARGETS`' (the toy: Llama-3.1-8B's
    with the toy's sizes and no special ids), so that `target_config_from_hf` of them is the shape
    ours decodes (`gpu_speed.shapes`)."""
    from eagle3_jax.accelerators import specs

    tcfg, _ = gs.shapes(name)
    fields = dict(specs.REAL_TARGETS["llama31_8b" if name == "tiny" else name])
    fields.update(
        vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size,
        intermediate_size=tcfg.intermediate_size, num_hidden_layers=tcfg.num_layers,
        num_attention_heads=tcfg.num_heads, num_key_value_heads=tcfg.num_kv_heads,
    )  # fmt: skip
    if "head_dim" in fields:
        fields["head_dim"] = tcfg.head_dim
    if name == "tiny":
        fields.update(bos_token_id=None, eos_token_id=None)
    return fields


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    """The same random prompt ids in both phases (seeded)."""
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(1, vocab, size=(batch, length)).tolist()


# ============================================================================= the step


def step(args: argparse.Namespace) -> int:
    """Runs the phases within --minutes, writing summary.json and report.md after each; 1 when
    ours measured nothing or a phase failed (theirs unavailable is a result, not a failure)."""
    c.check_budget(args.minutes)
    out = Path(args.out or (c.ROOT / "runs")) / "peers"
    out.mkdir(parents=True, exist_ok=True)
    log = c.Log(out / "device_log.txt")
    log(f"peers start: {c.accelerator()}")
    env = c.base_env()
    env["PYTHONPATH"] = os.pathsep.join([str(c.ROOT / "scripts"), env["PYTHONPATH"]])
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(c.DEVICE / "jax_cache"))
    phases = [p for p in PHASES if p in args.phases.split(",")]
    status: dict[str, Any] = {}
    start = gs.START_S["tiny" if args.target == "tiny" else "gpu"]
    for i, name in enumerate(phases):
        later = sum(SHARES[p] for p in phases[i:])
        timeout = (log.left(args.minutes) - RESERVE_S) * SHARES[name] / later
        penv = dict(env)
        if name == "theirs":
            penv["JAX_PLATFORMS"] = "cpu"  # jax, imported for the shapes, keeps off the GPU
        cmd = [sys.executable, "-m", "device_steps.peers", name, "--out", str(out),
               "--deadline-s", f"{max(timeout - start, 0):.0f}", *forward(args)]  # fmt: skip
        t0 = time.monotonic()
        rc = c.phase(log, name, cmd, penv, timeout, log_dir=out)
        status[name] = {"rc": rc, "seconds": round(time.monotonic() - t0, 1)}
        summary = write_summary(out, args, status)
        log(f"{name}: ratio so far {summary['ratio']} -> {out / 'summary.json'}")
    summary = write_summary(out, args, status)
    failed = any(s["rc"] not in (0, -1) for s in status.values())  # -1: no time
    return 0 if summary["ours_tok_s"] and not failed else 1


# ----------------------------------------------------------------------------- the summary


def write_summary(out: Path, args: argparse.Namespace, status: dict) -> dict:
    """summary.json and report.md from ours.json and theirs.json as found in `out`."""
    ours = gs._read(out / "ours.json") or {}
    theirs = gs._read(out / "theirs.json") or {}
    compiled = theirs.get("compiled")
    by_batch = {r["batch"]: r for r in theirs.get("rows", [])}
    rows = []
    for r in ours.get("rows", []):
        t = by_batch.get(r["batch"], {}).get("tok_s")
        row = {"batch": r["batch"], "ours_tok_s": r["tok_s"]}
        eager = compiled is False  # None: theirs did not run (or is not available)
        row["transformers_eager_tok_s" if eager else "transformers_compile_tok_s"] = t
        row["ratio_eager" if eager else "ratio"] = r["tok_s"] / t if t else None
        rows.append(row)
    head = rows[0] if rows else {}
    summary = {
        "device": ours.get("device") or theirs.get("device"),
        "date": time.strftime("%Y-%m-%d"),
        "target": args.target,
        "batch": head.get("batch"),
        "prompt": args.prompt,
        "new": args.new,
        "dtype": ours.get("dtype"),
        "ours_tok_s": head.get("ours_tok_s"),
        "transformers_compile_tok_s": head.get("transformers_compile_tok_s"),
        "ratio": head.get("ratio"),
        "torch": theirs.get("torch"),
        "transformers": theirs.get("transformers"),
        "jax": ours.get("jax"),
        "available": theirs.get("available"),
        "why": theirs.get("why"),
        "compiled": compiled,
        "rows": rows,
        "ours": {
            k: ours.get(k)
            for k in ("platform", "attention", "fused_projections", "xla_flags", "init_s")
        },
        "theirs": {
            k: theirs.get(k)
            for k in ("device", "recipe", "attn_implementation", "compile_error", "init_s")
        },
        "timings": {"ours": ours.get("rows", []), "theirs": theirs.get("rows", [])},
        "skipped": ours.get("skipped", []) + theirs.get("skipped", []),
        "failed": ours.get("failed", []) + theirs.get("failed", []),
        "phases": status,
    }
    if compiled is False and head.get("transformers_eager_tok_s"):
        summary["transformers_eager_tok_s"] = head["transformers_eager_tok_s"]
        summary["ratio_eager"] = head["ratio_eager"]
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    tmp.replace(out / "summary.json")
    (out / "report.md").write_text(report(summary))
    return summary


def report(s: dict) -> str:
    """summary.json as markdown: tokens/s of each engine by batch and their ratio."""
    f = gs._f
    ours, theirs = s.get("ours", {}), s.get("theirs", {})
    eager = s.get("compiled") is False
    kind = "eager (torch.compile failed)" if eager else "torch.compile"
    lines = [
        f"# Peers: plain greedy decoding on {s.get('device')} ({s.get('date')})",
        "",
        f"{s.get('target')}'s shape, random {s.get('dtype')} weights, prompt {s.get('prompt')} "
        f"tokens, {s.get('new')} new tokens a row (EOS off); tokens/s over the whole generate "
        "(prefill included), the median of the timed calls, compilation excluded.",
        "",
        f"- ours: eagle3_jax `plain.generate` (jax {s.get('jax')}; attention "
        f"{ours.get('attention')}, fused projections {ours.get('fused_projections')})",
    ]
    if s.get("available") is False:
        lines.append(f"- theirs: not available: {s.get('why')}")
    elif s.get("available"):
        lines.append(
            f"- theirs: transformers {s.get('transformers')} (torch {s.get('torch')}, "
            f"{theirs.get('device')}, attention {theirs.get('attn_implementation')}), static "
            f"cache, {kind}: {theirs.get('recipe')}"
        )
        if theirs.get("compile_error"):
            lines.append(f"- torch.compile's error: {theirs['compile_error']}")
    col = "transformers_eager_tok_s" if eager else "transformers_compile_tok_s"
    ratio = "ratio_eager" if eager else "ratio"
    lines += [
        "",
        f"| batch | ours tokens/s | transformers ({kind}) tokens/s | ours / theirs |",
        "|---:|---:|---:|---:|",
    ]
    for r in s.get("rows", []):
        lines.append(
            f"| {r['batch']} | {f(r['ours_tok_s'])} | {f(r.get(col))} | {f(r.get(ratio))} |"
        )
    if not s.get("rows"):
        lines.append("| - | nothing measured | | |")
    for key, title in (("skipped", "Skipped (the deadline)"), ("failed", "Failed")):
        if s.get(key):
            lines += ["", f"{title}:", ""] + [f"- {x}" for x in s[key]]
    return "\n".join(lines) + "\n"


# ============================================================================= the phases
# (subprocesses: they import jax or torch)


class _Results(c.PhaseResults):
    """A phase's results file (`common.PhaseResults`, with its "rows") and its deadline."""

    def __init__(self, path: Path, deadline_s: float, **fields):
        super().__init__(path, **fields, rows=[])
        self.deadline = self.t0 + deadline_s

    def fits(self, what: str, need_s: float) -> bool:
        left = self.deadline - time.monotonic()
        return need_s <= left or self.skip(f"{what}: needs ~{need_s:.0f} s, {left:.0f} s left")


def _row(batch: int, new: int, walls: list[float], warmup_s: float, **extra) -> dict:
    """One batch's timing: tokens/s of the median call; `warmup_s` the compiling calls' time."""
    med = statistics.median(walls)
    return {"batch": batch, "tok_s": batch * new / med, "median_s": med, "walls_s": walls,
            "ms_per_token": 1e3 * med / new, "warmup_s": round(warmup_s, 1), **extra}  # fmt: skip


def run_ours(args: argparse.Namespace) -> dict:
    """Phase `ours`: random weights laid out as `backends.prepare_target` lays them out, each
    batch's `plain.generate` compiled by a warm-up call, then timed -> ours.json."""
    from eagle3_jax import backends

    xla_flags = backends.set_xla_flags()  # before jax starts its backend, as decoding does
    import jax

    from eagle3_jax.checkpoints import Target
    from eagle3_jax.config import default_dtype
    from eagle3_jax.decoding import plain
    from eagle3_jax.models import target as tgt

    name, platform, _ = gs._device()
    dtype = default_dtype(None if args.dtype == "auto" else args.dtype)
    tcfg, _ = gs.shapes(args.target)
    ph = _Results(Path(args.out) / "ours.json", args.deadline_s, device=name, platform=platform,
                  jax=jax.__version__, target=args.target, dtype=jax.numpy.dtype(dtype).name,
                  xla_flags=xla_flags)  # fmt: skip
    t = time.monotonic()
    try:
        avals = jax.eval_shape(lambda k: tgt.init_params(tcfg, k, dtype=dtype), jax.random.key(0))
        target = Target(gs.random_weights(avals, 0), tcfg, None, Path(f"random {args.target}"))
        target = backends.prepare_target(target)  # products: the config's (plain)
    except Exception as e:  # noqa: BLE001
        ph.fail(f"ours {args.target}: weights", e)
        return ph.res
    ph.res.update(init_s=round(time.monotonic() - t, 1), attention=target.cfg.attention,
                  fused_projections=backends.fuse_projections_wanted())  # fmt: skip
    ph.save()
    last = 0.0
    for b in (int(v) for v in args.batches.split(",")):
        what = f"ours batch {b}"
        if last and not ph.fits(what, NEXT_BATCH_MARGIN * last):
            continue
        t = time.monotonic()
        ids = prompts(b, args.prompt, tcfg.vocab_size)
        try:
            res = plain.generate(target.params, target.cfg, ids, args.new, eos_ids=(), warmup=True)
            warmup_s = time.monotonic() - t - res.wall_time_s
            walls = [res.wall_time_s]
            for _ in range(args.reps - 1):
                res = plain.generate(target.params, target.cfg, ids, args.new, eos_ids=())
                walls.append(res.wall_time_s)
            made = {len(o) for o in res.output_ids}
            if made != {args.new}:
                raise RuntimeError(f"made {sorted(made)} tokens a row, not {args.new}")
        except Exception as e:  # noqa: BLE001
            ph.fail(what, e)
            continue
        last = time.monotonic() - t
        ph.res["rows"].append(_row(b, args.new, walls, warmup_s))
        print(json.dumps(ph.res["rows"][-1]), flush=True)
        ph.save()
    return ph.res


def _unavailable(ph: _Results, why: str) -> dict:
    ph.res.update(available=False, why=why)
    print(f"transformers not available: {why}", flush=True)
    ph.save()
    return ph.res


def run_theirs(args: argparse.Namespace) -> dict:
    """Phase `theirs`: transformers' model of the family from the same config, random init, on
    the chip ours ran on, static-cache greedy `generate` under torch.compile, warmed up, then
    timed -> theirs.json (`available` false, with why, where it cannot run here)."""
    out = Path(args.out)
    ours = gs._read(out / "ours.json") or {}
    platform = ours.get("platform") or ("cpu" if args.target == "tiny" else "gpu")
    ph = _Results(out / "theirs.json", args.deadline_s, target=args.target, available=None,
                  torch=None, transformers=None)  # fmt: skip
    try:
        import torch
    except ImportError as e:
        return _unavailable(ph, f"no torch here ({e})")
    ph.res["torch"] = torch.__version__
    try:
        import transformers
    except ImportError as e:
        return _unavailable(ph, f"torch {torch.__version__} but no transformers here ({e})")
    ph.res["transformers"] = transformers.__version__
    cuda = torch.cuda.is_available()
    if platform != "cpu" and not cuda:
        return _unavailable(
            ph, f"torch {torch.__version__} has no CUDA here (ours ran on {ours.get('device')})"
        )
    dev = torch.device("cuda" if platform != "cpu" else "cpu")
    dname = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    dtype_name = args.dtype  # auto: ours' (the backend's default)
    if dtype_name == "auto":
        dtype_name = ours.get("dtype") or ("float32" if dev.type == "cpu" else "bfloat16")
    ph.res.update(available=True, device=dname, dtype=dtype_name)
    t = time.monotonic()
    try:
        model = _model(args.target, dev, getattr(torch, TORCH_DTYPES[dtype_name]))
    except Exception as e:  # noqa: BLE001
        ph.fail(f"theirs {args.target}: the model", e)
        return ph.res
    ph.res.update(init_s=round(time.monotonic() - t, 1), model=type(model).__name__,
                  attn_implementation=getattr(model.config, "_attn_implementation", None))  # fmt: skip
    gen, recipe = _compiled_generate(model, dev)
    ph.res.update(recipe=recipe, compiled=None, compile_error=None)
    ph.save()
    last = 0.0
    for b in (int(v) for v in args.batches.split(",")):
        what = f"theirs batch {b}"
        if last and not ph.fits(what, NEXT_BATCH_MARGIN * last):
            continue
        t = time.monotonic()
        ids = torch.tensor(prompts(b, args.prompt, model.config.vocab_size), device=dev)
        torch._dynamo.reset()  # each batch compiled for its own static shapes
        graphs = _graphs()
        try:
            if ph.res["compiled"] is not False:
                try:
                    gen(ids, args.new)  # compiles
                    gen(ids, args.new)  # CUDA graphs recorded (reduce-overhead)
                    made = _graphs() - graphs
                    if not made:
                        raise RuntimeError("generate ran without compiling (dynamo made no graph)")
                    ph.res["compiled"] = True
                except Exception as e:  # noqa: BLE001
                    if ph.res["compiled"]:  # compiled before: this batch failed, not compile
                        raise
                    ph.res.update(compiled=False, compile_error=f"{type(e).__name__}: {e}"[:500])
                    print(f"torch.compile failed, timing eager: {e}", flush=True)
                    torch._dynamo.reset()
                    gen, recipe = _compiled_generate(model, dev, compile=False)
                    ph.res["recipe"] = recipe
            if ph.res["compiled"] is False:
                gen(ids, args.new)  # warm-up
            warmup_s = time.monotonic() - t
            walls = []
            for _ in range(args.reps):
                t1 = time.perf_counter()
                seq = gen(ids, args.new)
                walls.append(time.perf_counter() - t1)
            if tuple(seq.shape) != (b, args.prompt + args.new):
                raise RuntimeError(f"generate returned {tuple(seq.shape)}")
        except Exception as e:  # noqa: BLE001
            ph.fail(what, e)
            continue
        last = time.monotonic() - t
        row = _row(b, args.new, walls, warmup_s, graphs=_graphs() - graphs,
                   compiled=ph.res["compiled"])  # fmt: skip
        ph.res["rows"].append(row)
        print(json.dumps(row), flush=True)
        ph.save()
    return ph.res


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _model(target: str, dev, dtype):
    """transformers' causal LM of the family from `hf_config(target)`, its own random init
    (normal(0, 0.02), as ours), made on `dev` in `dtype`, in eval mode, EOS off."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle3_jax.config import FAMILIES

    fields = hf_config(target)
    model_type = FAMILIES[fields["architectures"][0]]  # our family names are HF's model types
    cfg = AutoConfig.for_model(model_type, **fields)
    with torch.device(dev):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except TypeError:  # transformers before 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    model.eval()
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.bos_token_id = None, 0, None
    return model


def _compiled_generate(model, dev, compile: bool = True):
    """(gen(ids, new) -> the generated sequences, waited for; the recipe in words): greedy,
    static cache, under torch.compile as the installed transformers documents it (or eager)."""
    import torch
    import transformers

    kw: dict[str, Any] = {}
    if not compile:
        recipe = 'generate(cache_implementation="static", disable_compile=True)'
        kw["disable_compile"] = True
    elif hasattr(transformers, "CompileConfig"):
        cc = transformers.CompileConfig(**COMPILE_OPTIONS)
        if dev.type != "cuda":
            cc._compile_all_devices = True  # transformers compiles only on accelerators else
        kw["compile_config"] = cc
        recipe = ('generate(cache_implementation="static", compile_config=CompileConfig('
                  'fullgraph=True, mode="reduce-overhead"))')  # fmt: skip
    else:
        model.forward = torch.compile(model.forward, **COMPILE_OPTIONS)
        recipe = (
            'model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)'
        )

    def gen(ids, new: int):
        with torch.inference_mode():
            seq = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                cache_implementation="static", max_new_tokens=new, **kw,
            )  # fmt: skip
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return seq

    return gen, recipe


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("phase", choices=PHASES)
    add_args(p)
    p.add_argument("--out", required=True)
    p.add_argument("--deadline-s", type=float, required=True, help="stop starting batches after")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    res = {"ours": run_ours, "theirs": run_theirs}[args.phase](args)
    print(f"{args.phase}: {len(res['rows'])} batches, {len(res['skipped'])} skipped, "
          f"{len(res['failed'])} failed")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
