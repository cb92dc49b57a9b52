"""Seconds per round at 4 busy slots of 4 (4 MT-bench first turns, 400-token limit, after 3
rounds): the CPU default tree with the head, plain rounds in an engine with the head (schedule
'1-:plain'), and a vanilla engine; each twice, interleaved.

  .venv/bin/python benchmarks/results/serving_cpu/round_cost.py
"""

import time

from eagle3_jax.cli import decode, decode_flags, serve
from eagle3_jax.decoding.generate import DecodeOptions
from eagle3_jax.decoding.slots import SlotEngine, TreeSchedule
from eagle3_jax.evaluation.questions import load_questions
from eagle3_jax.prompts import encode_chat

args = serve.parse_args(["--slots", "4", "--max-context", "1024", "--max-new-tokens", "400"])
serve.check(args)
target, head, mc = decode._load(args)
tree = decode_flags.tree_of(args)
qs = load_questions("mt_bench")
prompts = [encode_chat(target.tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in qs[:4]]
for name, method, h, sched in (
    ("eagle3 tree", "eagle3", head, None),
    ("eagle3 engine, plain rounds", "eagle3", head, "1-:plain"),
    ("vanilla engine", "vanilla", None, None),
) * 2:
    opts = DecodeOptions(method, 400, tree, max_context=mc, same_engine=True)
    s = TreeSchedule.parse(sched, tree) if sched else None
    eng = SlotEngine(target, h, opts, 4, s)
    serve.warm(eng)
    for i, p in enumerate(prompts):
        eng.admit(f"r{i}", p, 400)
    for _ in range(3):
        eng.step()
    n, toks, t0 = 30, 0, time.perf_counter()
    for _ in range(n):
        toks += sum(len(u.new_ids) for u in eng.step())
    dt = (time.perf_counter() - t0) / n
    print(
        f"{name}: {1e3 * dt:.1f} ms/round, {toks / n:.2f} tokens/round, {toks / n / dt:.1f} tok/s",
        flush=True,
    )
