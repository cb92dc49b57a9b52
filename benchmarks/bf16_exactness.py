#!/usr/bin/env python
"""How far greedy speculative decoding stays plain decoding's output in bfloat16 and in float32.

  .venv/bin/python benchmarks/bf16_exactness.py [--per-category 2] [--new 128] [--dtypes float32,bfloat16]

Speculative decoding is exact in exact arithmetic: every token it emits is the target's argmax
after the same prefix. In floating point a verification computes those logits over several tokens
at once, with sums in another order than a decode step over one, so its logits differ a little
from plain decoding's; a greedy choice flips where that difference exceeds the top-two gap.
Two measurements on the embedded SmolLM2-135M-Instruct and its shipped head, per dtype:

1. the logits of one verification of 4 tokens (the cache read, the new tokens attending to each
   other, as the engine verifies) against 4 decode steps over the same tokens: the largest
   difference, and the first layer whose hidden state differs at each position;
2. greedy answers to MT-bench first turns (the first N questions of each of its 8 categories, the
   chat template, --new tokens): plain decoding and speculative decoding (decode.py's default
   tree for the backend, or --tree), how many answers are identical and the mean length of the
   common prefix, against plain decoding in the same dtype and against fp32 plain decoding (what
   the dtype itself changes).

Prints both tables and writes benchmarks/results/bf16_exactness.json (the answers included).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import backends, cpu_tuning
from eagle3_jax.checkpoints import load_target
from eagle3_jax.checkpoints.heads import load_head
from eagle3_jax.decoding.generate import DecodeOptions, generate_ids
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.decoding.tree import default_tree
from eagle3_jax.evaluation.metrics import common_prefix
from eagle3_jax.evaluation.questions import load_questions
from eagle3_jax.heads import default_head
from eagle3_jax.models import target as tgt
from eagle3_jax.models.layers import causal_mask
from eagle3_jax.paths import cpu_model
from eagle3_jax.prompts import encode_chat

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
TEXT = "The quick brown fox jumps over the lazy dog, and then the dog chases the fox around"


def verify_against_steps(target, n: int = 4) -> dict:
    """Logits of the last n tokens of TEXT: one cache-reading forward of all n (the engine's
    verification) against n decode steps writing the cache one token at a time."""
    cfg, params = target.cfg, target.params
    ids = target.tokenizer(TEXT)["input_ids"]
    prompt, new = ids[:-n], ids[-n:]
    t, slots, layers = len(prompt), 64, cfg.num_layers
    dtype = jax.tree.leaves(params)[0].dtype
    every = tuple(range(layers + 1))
    zero = jnp.zeros((1,), jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    # jitted as the engine runs them (op by op, XLA would fuse nothing and sum differently)
    step = jax.jit(lambda p, *a: tgt.forward(p, *a[:3], cfg, *a[3:], aux_ids=every))
    verify = jax.jit(
        lambda p, tok, pos, mask, cache, w, new: tgt.forward(
            p, tok, pos, mask, cfg, cache, w, aux_ids=every, mask_new=new
        )
    )
    cache = jax.jit(lambda p, *a: tgt.forward(p, *a[:3], cfg, *a[3:]).cache)(
        params, jnp.asarray([prompt]), pos, causal_mask(zero, t, slots),
        tgt.make_cache(cfg, 1, slots, dtype), zero,
    )  # fmt: skip
    steps_h, steps_l, c = [], [], cache
    for i, tok in enumerate(new):
        cur = jnp.asarray([t + i], jnp.int32)
        o = step(params, jnp.asarray([[tok]]), cur[:, None], causal_mask(cur, 1, slots), c, cur)
        c = o.cache
        steps_h.append(np.asarray(o.aux[0, 0].astype(jnp.float32)))
        steps_l.append(np.asarray(o.logits[0, 0].astype(jnp.float32)))
    read = jnp.broadcast_to(jnp.arange(slots)[None, None] < t, (1, n, slots))
    o = verify(
        params, jnp.asarray([new]), (t + jnp.arange(n, dtype=jnp.int32))[None], read, cache,
        jnp.asarray([t]), jnp.tril(jnp.ones((n, n), bool))[None],
    )  # fmt: skip
    ver_h = np.asarray(o.aux[0].astype(jnp.float32))
    ver_l = np.asarray(o.logits[0].astype(jnp.float32))
    d = cfg.hidden_size
    first = []
    for i in range(n):
        a, b = steps_h[i].reshape(layers + 1, d), ver_h[i].reshape(layers + 1, d)
        diff = [j for j in range(layers + 1) if not np.array_equal(a[j], b[j])]
        first.append(diff[0] if diff else None)  # hidden_states index: the input to that layer
    return {
        "tokens": n,
        "max_logit_difference": float(max(np.abs(steps_l[i] - ver_l[i]).max() for i in range(n))),
        "first_differing_hidden_state": first,
        "logits_dtype": str(o.logits.dtype),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-category", type=int, default=2, help="MT-bench questions per category")
    ap.add_argument("--new", type=int, default=128, help="new tokens per answer")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--tree", default=None, help="top_k,depth,total[,threshold] (default: backend's)"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/bf16_exactness.json"))
    args = ap.parse_args()
    names = args.dtypes.split(",")
    if not set(names) <= set(DTYPES):
        sys.exit(f"--dtypes {args.dtypes}: choose from {', '.join(DTYPES)}")
    if args.tree:
        k, d, n, *th = args.tree.split(",")
        tree = default_tree(
            top_k=int(k), depth=int(d), total_tokens=int(n),
            verify_threshold=float(th[0]) if th else None,
        )  # fmt: skip
    else:
        tree = default_tree()
    qs, seen = [], {}
    for q in load_questions("mt_bench"):
        seen[q.category] = seen.get(q.category, 0) + 1
        if seen[q.category] <= args.per_category:
            qs.append(q)

    verify, answers, attention = {}, {q.id: {} for q in qs}, {}
    t0 = time.perf_counter()
    products = cpu_tuning.policy_for()  # as decode.py: this machine's few-row products
    for name in names:
        # as decode.py loads it (backends.py: EAGLE3_JAX_ATTENTION=mixed measures the attention
        # accelerators run bf16 weights with)
        target = backends.prepare_target(load_target(None, dtype=DTYPES[name]), products)
        attention[name] = target.cfg.attention
        head = load_head(str(default_head()), target, DTYPES[name])
        verify[name] = verify_against_steps(target)
        for q in qs:
            ids = [encode_chat(target.tokenizer, [{"role": "user", "content": q.turns[0]}], True)]
            a = answers[q.id]
            for method, m in (("plain", "vanilla"), ("speculative", "eagle3")):
                opts = DecodeOptions(m, args.new, tree, Sampling(), 0)
                a[f"{method}_{name}"] = generate_ids(target, head, ids, opts).output_ids[0]
            print(f"  {name} question {q.id} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)

    print(f"\n1. One verification of 4 tokens against 4 decode steps ({TEXT[:30]}...)\n")
    print("| dtype | largest logit difference | first differing hidden state, by position |")
    print("|---|---|---|")
    for name, v in verify.items():
        first = " ".join("-" if f is None else str(f) for f in v["first_differing_hidden_state"])
        print(f"| {name} | {v['max_logit_difference']:.3g} | {first} |")

    rows = []
    ref_name = "float32" if "float32" in names else None
    for name in names:
        for method in ("plain", "speculative"):
            key = f"{method}_{name}"
            row = {"dtype": name, "method": method}
            for against in ([f"plain_{name}"] if method == "speculative" else []) + (
                [f"plain_{ref_name}"] if ref_name and key != f"plain_{ref_name}" else []
            ):
                same = [a[key] == a[against] for a in answers.values()]
                pre = [common_prefix(a[key], a[against]) for a in answers.values()]
                row[against] = {
                    "identical": int(sum(same)),
                    "mean_common_prefix": float(np.mean(pre)),
                }
            rows.append(row)
    print(f"\n2. Greedy answers, {len(qs)} MT-bench first turns, {args.new} new tokens, tree "
          f"{tree.top_k},{tree.depth},{tree.total_tokens} θ {tree.verify_threshold}\n")  # fmt: skip
    print(
        "| dtype | method | identical to plain, same dtype (common prefix) "
        "| identical to fp32 plain (common prefix) |"
    )
    print("|---|---|---|---|")
    for r in rows:
        cells = []
        for against in (f"plain_{r['dtype']}", f"plain_{ref_name}"):
            c = r.get(against)
            cells.append(f"{c['identical']}/{len(qs)} ({c['mean_common_prefix']:.1f})" if c else "")
        print(
            f"| {r['dtype']} | {r['method']} | {cells[0]} | {cells[1] if r['dtype'] != ref_name else ''} |"
        )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": cpu_model(), "backend": jax.default_backend(), "jax": jax.__version__,
        "questions": [q.id for q in qs], "new_tokens": args.new,
        "tree": [tree.top_k, tree.depth, tree.total_tokens, tree.verify_threshold],
        "row_products_max": products.row_products,  # 0: few-row products as plain products
        "attention": attention,  # per dtype: exact or mixed (models.layers.attention)
    }  # fmt: skip
    out.write_text(
        json.dumps({"meta": meta, "verify": verify, "rows": rows, "answers": answers}) + "\n"
    )
    print(f"\nwrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
