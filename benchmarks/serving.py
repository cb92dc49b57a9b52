#!/usr/bin/env python
"""Load on a running `python -m eagle3_jax serve` through the openai client: streamed chat
requests arriving as a Poisson process, per-request time to first token and latency, and the
output tokens per second over the run.

  .venv/bin/python -m eagle3_jax serve --slots 4 --port 8000 &
  .venv/bin/python benchmarks/serving.py --url http://127.0.0.1:8000/v1 --requests 32 --rate 2 \
      --max-tokens 128 --out benchmarks/results/serving.json

Prompts are the first turns of a benchmark's questions (`--bench`, as eval takes it), cycled.
`--rate inf` sends every request at once. Needs the openai package (`pip install openai`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from eagle3_jax.evaluation.questions import load_questions


async def _one(client, model: str, text: str, max_tokens: int, seed: int) -> dict:
    t0 = time.perf_counter()
    first, parts, usage, reason = None, [], None, None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True}, seed=seed,
    )  # fmt: skip
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                first = first or time.perf_counter()
                parts.append(c.delta.content)
            reason = c.finish_reason or reason
    end = time.perf_counter()
    return {
        "ttft_s": (first or end) - t0,
        "latency_s": end - t0,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else None,
        "finish_reason": reason,
        "text": "".join(parts),
    }


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run(url: str, texts: list[str], rate: float, max_tokens: int, seed: int = 0) -> dict:
    """Sends `texts` (one streamed chat request each) at `rate` requests/s (Poisson; inf: all at
    once) and summarizes: per request TTFT, latency and tokens, and the whole run's figures."""
    from openai import AsyncOpenAI  # the benchmark's own dependency, not the package's

    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    rng = random.Random(seed)
    t0 = time.perf_counter()
    tasks = []
    for i, text in enumerate(texts):
        tasks.append(asyncio.create_task(_one(client, model, text, max_tokens, seed + i)))
        if rate != float("inf") and i + 1 < len(texts):
            await asyncio.sleep(rng.expovariate(rate))
    rows = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    out_tokens = sum(r["completion_tokens"] or 0 for r in rows)
    ttft, lat = [r["ttft_s"] for r in rows], [r["latency_s"] for r in rows]
    summary = {
        "model": model,
        "requests": len(rows),
        "rate": rate,
        "max_tokens": max_tokens,
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "requests_per_s": len(rows) / wall,
        "ttft_s": {"p50": statistics.median(ttft), "p90": _pct(ttft, 0.9), "max": max(ttft)},
        "latency_s": {"p50": statistics.median(lat), "p90": _pct(lat, 0.9), "max": max(lat)},
    }
    await client.close()
    return {"summary": summary, "requests": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--bench", default="mt_bench", help="questions whose first turns are prompts")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--rate", type=float, default=float("inf"), help="requests/s (inf: at once)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the summary and every request here")
    args = p.parse_args(argv)
    questions = load_questions(args.bench)
    texts = [questions[i % len(questions)].turns[0] for i in range(args.requests)]
    result = asyncio.run(run(args.url, texts, args.rate, args.max_tokens, args.seed))
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
