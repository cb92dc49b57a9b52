#!/usr/bin/env python
"""What a long prompt's arrival costs the requests already decoding, with and without a chunked
prefill (`serve --prefill-chunk C`), on the slot engine serve runs (in process, no HTTP).

  .venv/bin/python benchmarks/chunked_prefill.py [--chunks 0,256,512] [--long 1536] \
      [--out benchmarks/results/chunked_prefill]

The embedded default (SmolLM2 and its shipped head, fp32 on the CPU), 4 slots, the tree flags'
tree every round. For each chunk size (0: the whole prompt in one pass): a short request
decodes; after 8 of its rounds a request with a --long token prompt arrives (both past EOS). Measured, per
setting, on a second run of the same scenario (the first compiles and warms every program):
the running request's gaps between token deliveries before the arrival (median) and after it
(median and longest: a one-pass admission stalls it for the whole prefill, a chunked one for
one chunk's forward a round), and the long request's time to first token from its arrival.
Greedy outputs are checked equal across settings' own decode (`--prefill-chunk C` alone).
Then (--shared): a --long prompt beginning with an earlier one's first --shared tokens, its
time to first token with chunks of 256 without a prefix cache and with one (`serve
--prefix-cache-mb`), the earlier one decoded first. Prints tables, writes
OUT/chunked_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from eagle3_jax.cli import decode, serve
from eagle3_jax.decoding import plain
from eagle3_jax.decoding.generate import generate_ids

SHORT, SHORT_NEW, LONG_NEW, ARRIVE = 24, 96, 16, 8


def scenario(engine, short: list[int], long: list[int]) -> dict:
    """One run: the short request alone for ARRIVE rounds, then the long one admitted; each
    request's delivery times and tokens until both end."""
    t0 = time.perf_counter()
    engine.admit("short", short, SHORT_NEW, ignore_eos=True)
    times = {"short": [], "long": []}
    tokens = {"short": [], "long": []}
    arrived = None
    rounds = 0
    while len(times["short"]) == 0 or engine.busy():
        if rounds == ARRIVE:
            arrived = time.perf_counter()
            engine.admit("long", long, LONG_NEW, ignore_eos=True)  # one pass: prefilled here
        for u in engine.step():
            if u.new_ids:
                times[u.request].append(time.perf_counter())
                tokens[u.request] += u.new_ids
        rounds += 1
    before = [b - a for a, b in zip(times["short"], times["short"][1:]) if b <= arrived]
    after = [b - a for a, b in zip(times["short"], times["short"][1:]) if b > arrived]
    return {
        "gap_before_ms": 1e3 * statistics.median(before),
        "gap_after_median_ms": 1e3 * statistics.median(after) if after else None,
        "gap_after_max_ms": 1e3 * max(after) if after else None,
        "long_ttft_s": times["long"][0] - arrived,
        "wall_s": time.perf_counter() - t0,
        "tokens": tokens,
    }


def follow_up(engine, first: list[int], second: list[int]) -> dict:
    """`first` decoded to its end, then `second` (which begins with `first`'s opening): the
    second's time to first token from its admission, and both requests' tokens."""
    tokens = {}
    for name, prompt in (("first", first), ("second", second)):
        t0 = time.perf_counter()
        engine.admit(name, prompt, LONG_NEW, ignore_eos=True)
        ttft, out = None, []
        while engine.busy():
            for u in engine.step():
                out += u.new_ids
                ttft = ttft or (time.perf_counter() - t0 if u.new_ids else None)
        tokens[name] = out
    return {"second_ttft_s": ttft, "tokens": tokens}


def compiled_engine(target, head, max_context, flags: list[str], lengths) -> object:
    """serve's engine for `flags`, its admissions of prompts of `lengths` and its rounds
    compiled."""
    args = serve.parse_args(flags)
    serve.check(args)
    engine = serve.build_engine(args, target, head, max_context)
    engine.compile_admissions(sorted({plain.round_up(n, plain.PROMPT_BUCKET) for n in lengths}))
    engine.compile_rounds()
    return engine


def prefix_rows(target, head, max_context, base, chunk, first, second, mb) -> list[dict]:
    """`follow_up` without and with a prefix cache of `mb` MB, at `chunk`."""
    rows = []
    for size in (0, mb):
        engine = compiled_engine(target, head, max_context,
                                 [*base, "--prefill-chunk", str(chunk), "--prefix-cache-mb",
                                  str(size)], (len(first), len(second)))  # fmt: skip
        follow_up(engine, first, second)  # warm: every program run once
        if engine.prefix is not None:
            engine.prefix.entries.clear()
            engine.prefix.bytes = engine.prefix.hit_tokens = engine.prefix.query_tokens = 0
        got = follow_up(engine, first, second)
        opts = replace(engine.opts, eos_ids=(), max_new_tokens=LONG_NEW)
        alone = {k: generate_ids(target, head, [p], opts).output_ids[0]
                 for k, p in (("first", first), ("second", second))}  # fmt: skip
        rows.append({"prefix_cache_mb": size, "prefill_chunk": chunk,
                     "second_ttft_s": got["second_ttft_s"],
                     "hit_tokens": engine.prefix.hit_tokens if engine.prefix else 0,
                     "equal_to_decode_alone": got["tokens"] == alone})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="0,256,512", help="prefill chunk sizes (0: one pass)")
    ap.add_argument("--long", type=int, default=1536, help="the arriving prompt's tokens")
    ap.add_argument("--out", default=None, help="folder for chunked_prefill.json")
    ap.add_argument("--shared", type=int, default=1280,
                    help="then, with --prefill-chunk 256: a --long prompt beginning with an "
                    "earlier one's first SHARED tokens, its TTFT without and with a prefix cache "
                    "(0: skip)")  # fmt: skip
    a = ap.parse_args(argv)
    chunks = [int(c) for c in a.chunks.split(",")]
    context = plain.round_up(a.long + LONG_NEW + 128, plain.PROMPT_BUCKET)
    base = ["--slots", "4", "--max-context", str(context), "--max-new-tokens", str(SHORT_NEW),
            "--tree-by-occupancy", "fixed"]  # fmt: skip
    args = serve.parse_args(base)
    serve.check(args)
    target, head, max_context = decode._load(args)
    rng = np.random.default_rng(0)
    vocab = target.cfg.vocab_size
    short = [int(x) for x in rng.integers(100, vocab, SHORT)]
    long = [int(x) for x in rng.integers(100, vocab, a.long)]
    rows = []
    for chunk in chunks:
        engine = compiled_engine(target, head, max_context,
                                 [*base, "--prefill-chunk", str(chunk)], (SHORT, a.long))  # fmt: skip
        scenario(engine, short, long)  # compiles nothing new; runs every program once
        got = scenario(engine, short, long)
        opts = replace(engine.opts, eos_ids=())  # past EOS, as the engine's requests go
        alone = {
            k: generate_ids(target, head, [p], replace(opts, max_new_tokens=n)).output_ids[0]
            for k, p, n in (("short", short, SHORT_NEW), ("long", long, LONG_NEW))
        }
        rows.append({"prefill_chunk": chunk, **{k: v for k, v in got.items() if k != "tokens"},
                     "equal_to_decode_alone": got["tokens"] == alone})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{a.long}-token prompt arriving while one request decodes (SmolLM2, CPU, 4 slots):\n")
    print("| prefill chunk | gap before (ms) | gap after, median (ms) | gap after, longest (ms) "
          "| long request's TTFT (s) | equal to decode alone |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['prefill_chunk'] or 'one pass'} | {r['gap_before_ms']:.0f} | "
              f"{r['gap_after_median_ms']:.0f} | {r['gap_after_max_ms']:.0f} | "
              f"{r['long_ttft_s']:.2f} | {r['equal_to_decode_alone']} |")  # fmt: skip
    prefix = []
    if a.shared:
        second = long[: a.shared] + [int(x) for x in rng.integers(100, vocab, a.long - a.shared)]
        prefix = prefix_rows(target, head, max_context, base, 256, long, second, 512)
        print(f"\na {a.long}-token prompt beginning with an earlier one's {a.shared} tokens, "
              "--prefill-chunk 256:\n")  # fmt: skip
        print("| prefix cache | tokens restored | its first token (s) | equal to decode alone |")
        print("|---|---:|---:|---|")
        for r in prefix:
            size = f"{r['prefix_cache_mb']} MB" if r["prefix_cache_mb"] else "off"
            print(f"| {size} | {r['hit_tokens']} | {r['second_ttft_s']:.2f} | "
                  f"{r['equal_to_decode_alone']} |")  # fmt: skip
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        rec = {"long_prompt": a.long, "short_prompt": SHORT, "arrives_after_rounds": ARRIVE,
               "machine": platform.processor() or platform.machine(), "rows": rows,
               "shared_prefix": a.shared, "prefix_cache": prefix}  # fmt: skip
        (out / "chunked_prefill.json").write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
