#!/usr/bin/env python
"""Load on a running `python -m eagle3_jax serve` through the openai client: streamed chat
requests arriving as a Poisson process, per-request time to first token and latency, and the
output tokens per second over the run.

  .venv/bin/python -m eagle3_jax serve --slots 4 --port 8000 &
  .venv/bin/python benchmarks/serving.py --url http://127.0.0.1:8000/v1 --requests 32 --rate 2 \
      --max-tokens 128 --out benchmarks/results/serving.json

Prompts are the first turns of a benchmark's questions (`--bench`, as eval takes it), cycled.
`--rate inf` sends every request at once. Needs the openai package (`pip install openai`).

`--sweep` starts two servers itself (`python -m eagle3_jax serve` with `--serve-args`), one with
EAGLE-3 rounds and one with `--method vanilla` (plain rounds through the same engine), both up
side by side, and runs closed-loop levels on the same prompts at each `--concurrency` (N
clients, each sending its next request when its last one ended), each level on one server and
then the other, `--repeats` times in alternating order (A B, B A), so that the machine's drift
falls on both; each pair's ratio is reported. Per level: output tokens/s, time to first token
and time per output token (p50, p99), τ and the rounds by tree from /metrics. Then, with the
servers stopped, it decodes every prompt alone in-process (`generate_ids`, batch 1, the same
chat-templated ids and max_tokens: EAGLE-3 and plain decoding's own loop, timed after a
warm-up) and checks each greedy output's token ids against it:

  .venv/bin/python benchmarks/serving.py --sweep --repeats 2 --concurrency 1 4 8 16 --requests 32 \
      --max-tokens 64 --serve-args "--slots 4 --max-context 1024" \
      --out benchmarks/results/serving_cpu/serving.json

`--sweep --in-process` runs the same levels without HTTP: the engine and scheduler `serve` would
run, built in this process (`serve.build_engine`), one client thread per concurrent request;
what a round and the scheduler cost, not the front end. It needs none of the serve extra's
packages, so it is what the device job runs (`scripts/device_job.py serving`). With a
`--method` in --serve-args (pld) that method stands in for EAGLE-3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from eagle3_jax.evaluation.questions import load_questions


async def _one(client, model: str, text: str, max_tokens: int, seed: int) -> dict:
    t0 = time.perf_counter()
    first, parts, ids, usage, reason = None, [], [], None, None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True}, seed=seed, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            new = getattr(c, "token_ids", None) or []
            if c.delta.content or new:
                first = first or time.perf_counter()
            parts.append(c.delta.content or "")
            ids.extend(new)
            reason = c.finish_reason or reason
    end = time.perf_counter()
    return {
        "token_ids": ids,
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


# ---------------------------------------------------------------------- --sweep: closed loop


async def closed_loop(url: str, texts: list[str], clients: int, max_tokens: int) -> dict:
    """`clients` workers share `texts`, each sending its next request (streamed, greedy) when its
    last one ended; the level's figures and every request in the order of `texts`."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    todo, rows = list(enumerate(texts)), [None] * len(texts)

    async def worker():
        while todo:
            i, text = todo.pop(0)
            rows[i] = await _one(client, model, text, max_tokens, 0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()
    return _level(clients, rows, wall)


def _level(clients: int, rows: list[dict], wall: float) -> dict:
    """A closed-loop level's figures from its requests (in prompt order) and its wall time."""
    out_tokens = sum(r["completion_tokens"] or 0 for r in rows)
    ttft = [r["ttft_s"] for r in rows]
    tpot = [(r["latency_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1)
            for r in rows if (r["completion_tokens"] or 0) > 1]  # fmt: skip
    summary = {
        "concurrency": clients,
        "requests": len(rows),
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "ttft_s": {"p50": statistics.median(ttft), "p99": _pct(ttft, 0.99)},
        "tpot_s": {"p50": statistics.median(tpot), "p99": _pct(tpot, 0.99)},
    }
    return {"summary": summary, "requests": rows}


def _scrape(base: str) -> str:
    """The server's /metrics, as text."""
    return urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: list[str], log: Path, timeout_s: float = 900) -> tuple:
    """`python -m eagle3_jax serve` on a free localhost port; (process, base url) once /health
    answers 200."""
    port = _free_port()
    cmd = [sys.executable, "-m", "eagle3_jax", "serve", "--port", str(port), *serve_args]
    print("$", shlex.join(cmd), file=sys.stderr)
    # two servers share a GPU in a sweep: each takes at most 45 % of its memory, not JAX's 75 %
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    base, end = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode}: see {log}")
        try:
            if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                return proc, base
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health in {timeout_s:.0f} s: see {log}")


def stop_server(proc, timeout_s: float = 60) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _tree_rounds(text: str) -> dict[str, int]:
    """/metrics' rounds run by tree, so far."""
    pattern = r'^eagle3_tree_rounds_total\{tree="([^"]+)"\} (\S+)$'
    return {m.group(1): int(float(m.group(2))) for m in re.finditer(pattern, text, re.M)}


class HttpRun:
    """A `python -m eagle3_jax serve` process for `serve_args`, driven over HTTP by the openai
    client level by level (`EngineRun`'s interface): two of them up side by side let a sweep
    interleave EAGLE-3's and plain rounds' levels. serve compiles and runs every program before
    it answers /health (`serve.warm`), so no level pays a compile."""

    def __init__(self, name: str, serve_args, texts, log: Path):
        self.name, self.serve_args, self.texts = name, serve_args, texts
        self.proc, self.base = start_server(serve_args, log)
        self.exit_code = None

    def level(self, clients: int, max_tokens: int) -> dict:
        """One closed-loop level; τ from the change of /metrics' generated tokens and tokens
        per target pass, and the rounds run by tree so far."""
        before = _scrape(self.base)
        level = asyncio.run(closed_loop(self.base + "/v1", self.texts, clients, max_tokens))
        after = _scrape(self.base)
        (gen0, tau0), (gen1, tau1) = (
            (_metric(t, "eagle3_generation_tokens_total"), _metric(t, "eagle3_tau"))
            for t in (before, after)
        )  # fmt: skip
        passes = gen1 / tau1 - (gen0 / tau0 if tau0 else 0.0)
        s = level["summary"]
        s["tau"] = (gen1 - gen0) / passes if passes else None
        s["tree_rounds"] = _tree_rounds(after)
        print(f"  {self.name} c={clients}: {s['output_tokens_per_s']:.1f} tok/s, "
              f"tau {s['tau']:.2f}", file=sys.stderr)  # fmt: skip
        return level

    def stop(self) -> None:
        self.exit_code = stop_server(self.proc)


# ---------------------------------------------------------------------- --in-process: no HTTP


def _load(serve_args: list[str]):
    """(target, head, max_context) for serve's flags, the model loaded as serve loads it."""
    from eagle3_jax.cli import decode, serve

    args = serve.parse_args(serve_args)
    serve.check(args)
    return decode._load(args)


def _request(scheduler, ids: list[int], max_tokens: int) -> dict:
    """One greedy request through the scheduler, waited for on this thread: the row closed_loop
    makes of a streamed response (token ids, TTFT, latency, completion tokens)."""
    import queue
    import uuid

    from eagle3_jax.serving.scheduler import Job

    events: queue.Queue = queue.Queue()
    t0 = time.perf_counter()
    scheduler.submit(Job(uuid.uuid4().hex, ids, max_tokens, 0, events.put))
    first, out, reason = None, [], None
    while reason is None:
        ev = events.get()
        if ev.new_ids:
            first = first or time.perf_counter()
        out += ev.new_ids
        reason = ev.finish_reason
    end = time.perf_counter()
    if reason.startswith(("error", "cancelled")):
        raise RuntimeError(f"request ended {reason}")
    return {"token_ids": out, "ttft_s": (first or end) - t0, "latency_s": end - t0,
            "prompt_tokens": len(ids), "completion_tokens": len(out), "finish_reason": reason}  # fmt: skip


def engine_closed_loop(scheduler, prompts: list[list[int]], clients: int, max_tokens: int) -> dict:
    """closed_loop without HTTP: `clients` threads share the prompts (chat-templated ids), each
    submitting its next request to the scheduler when its last one ended; the same figures."""
    import threading

    todo, rows, lock = list(enumerate(prompts)), [None] * len(prompts), threading.Lock()

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i, ids = todo.pop(0)
            rows[i] = _request(scheduler, ids, max_tokens)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _level(clients, rows, time.perf_counter() - t0)


class EngineRun:
    """The engine and scheduler `serve` would run for `serve_args`, in this process and driven
    without HTTP (what a round and the scheduler cost, not the front end), level by level: two
    of them side by side let a sweep interleave EAGLE-3's and plain rounds' levels."""

    def __init__(self, serve_args, prompts, loaded=None):
        from eagle3_jax.cli import serve
        from eagle3_jax.serving.scheduler import Scheduler

        self.serve_args, self.prompts = serve_args, prompts
        self.args = serve.parse_args(serve_args)
        serve.check(self.args)
        serve.log_to_stderr()  # the tree choices, as serve logs them
        self.engine = serve.build_engine(self.args, *(loaded or _load(serve_args)))
        serve.warm(self.engine)
        self.scheduler = Scheduler(self.engine, max_queue=len(prompts) + 64).start()

    def level(self, clients: int, max_tokens: int) -> dict:
        """One closed-loop level; τ from the scheduler's counts (tokens per target pass of the
        ended requests), the rounds run by tree and the measured choice by occupancy so far."""
        from eagle3_jax.decoding.slots import tree_name

        st, engine = self.scheduler.stats, self.engine
        gen0, fw0 = st.generated, st.target_forwards
        level = engine_closed_loop(self.scheduler, self.prompts, clients, max_tokens)
        passes = st.target_forwards - fw0
        s = level["summary"]
        s["tau"] = (st.generated - gen0) / passes if passes else None
        s["tree_rounds"] = dict(engine.tree_rounds)
        chosen = getattr(engine.schedule, "best", {})  # a measured choice, by occupancy
        s["tree_choice"] = {str(n): tree_name(t) for n, t in chosen.items()}
        print(f"  {self.args.method} c={clients}: {s['output_tokens_per_s']:.1f} tok/s, "
              f"tau {s['tau']:.2f}", file=sys.stderr)  # fmt: skip
        return level

    def stop(self) -> None:
        self.scheduler.stop()
        self.exit_code = 0


def interleaved_levels(named_args: dict, make, levels, max_tokens, repeats: int) -> dict:
    """The runs of `named_args` ({name: serve_args}; `make(name, serve_args)` an `EngineRun` or
    an `HttpRun`) up side by side, each level run `repeats` times by each in turn, the order
    alternating (A B, then B A, ...), so that a drift of the machine falls on both alike:
    {name: {serve_args, exit_code, levels}}, each level the repeats' requests together (tok/s:
    their tokens over their summed wall time) with each repeat's summary under "repeats"."""
    runs = {}
    try:
        for name, serve_args in named_args.items():
            runs[name] = make(name, serve_args)
        names = list(runs)
        out = {name: [] for name in names}
        for n in levels:
            got = {name: [] for name in names}
            for r in range(repeats):
                for name in names if r % 2 == 0 else names[::-1]:
                    got[name].append(runs[name].level(n, max_tokens))
            for name in names:
                rows = [row for lv in got[name] for row in lv["requests"]]
                merged = _level(n, rows, sum(lv["summary"]["wall_s"] for lv in got[name]))
                last = got[name][-1]["summary"]
                tau = [lv["summary"]["tau"] for lv in got[name] if lv["summary"]["tau"]]
                merged["summary"].update(
                    tau=statistics.fmean(tau) if tau else None, tree_rounds=last["tree_rounds"],
                    tree_choice=last.get("tree_choice"),
                    repeats=[lv["summary"] for lv in got[name]],
                )  # fmt: skip
                out[name].append(merged)
    finally:
        for run in runs.values():
            run.stop()
    return {name: {"serve_args": named_args[name], "exit_code": runs[name].exit_code,
                   "levels": out[name]} for name in names}  # fmt: skip


def alone(serve_args, texts, max_tokens, loaded=None) -> dict:
    """Each prompt decoded alone in this process (batch 1, the server's model flags, the same
    chat-templated ids and max_tokens): EAGLE-3 and plain decoding, ids and timings."""
    from eagle3_jax.cli import decode, decode_flags, serve
    from eagle3_jax.decoding.generate import DecodeOptions, generate_ids
    from eagle3_jax.prompts import encode_chat

    args = serve.parse_args(serve_args)
    serve.check(args)
    target, head, max_context = loaded or decode._load(args)
    tree = decode_flags.tree_of(args)
    ids = [encode_chat(target.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    out = {"prompt_ids": ids}
    for name, method in (("eagle3", args.method), ("vanilla", "vanilla")):
        opts = DecodeOptions(method, max_tokens, tree, max_context=max_context)
        gens = [generate_ids(target, head if method == "eagle3" else None, [p], opts, warmup=True)
                for p in ids]  # fmt: skip
        tokens = sum(len(g.output_ids[0]) for g in gens)
        wall = sum(g.wall_time_s for g in gens)
        out[name] = {"output_ids": [g.output_ids[0] for g in gens], "tokens": tokens,
                     "wall_s": wall, "output_tokens_per_s": tokens / wall}  # fmt: skip
        print(f"  alone {method}: {tokens / wall:.1f} tok/s", file=sys.stderr)
    out["speedup"] = out["eagle3"]["output_tokens_per_s"] / out["vanilla"]["output_tokens_per_s"]
    return out


def sweep(args) -> dict:
    questions = load_questions(args.bench)
    texts = [questions[i % len(questions)].turns[0] for i in range(args.requests)]
    base_args = shlex.split(args.serve_args) + ["--max-new-tokens", str(args.max_tokens)]
    runs_dir = Path(args.out).parent if args.out else Path(".")
    runs_dir.mkdir(parents=True, exist_ok=True)
    loaded, prompts = None, None
    if args.in_process:  # one load for both engines and decoding alone
        from eagle3_jax.prompts import encode_chat

        loaded = _load(base_args)
        prompts = [encode_chat(loaded[0].tokenizer, [{"role": "user", "content": t}])
                   for t in texts]  # fmt: skip
    named = {"eagle3": base_args, "plain": base_args + ["--method", "vanilla"]}
    if args.tree_by_occupancy:
        named["eagle3"] = base_args + ["--tree-by-occupancy", args.tree_by_occupancy]

    def make(name, serve_args):
        if args.in_process:
            return EngineRun(serve_args, prompts, loaded)
        return HttpRun(name, serve_args, texts, runs_dir / f"server_{name}.log")

    runs = interleaved_levels(named, make, args.concurrency, args.max_tokens, args.repeats)
    ref = alone(shlex.split(args.serve_args), texts, args.max_tokens, loaded)
    for name, want in (("eagle3", ref["eagle3"]["output_ids"]),
                       ("plain", ref["vanilla"]["output_ids"])):  # fmt: skip
        for level in runs[name]["levels"]:  # every repeat's requests, in prompt order
            got = [r["token_ids"] for r in level["requests"]]
            level["summary"]["equal_to_alone"] = sum(g == want[i % len(want)]
                                                     for i, g in enumerate(got))  # fmt: skip
    table = []
    for i, n in enumerate(args.concurrency):
        e, p = (runs[k]["levels"][i]["summary"] for k in ("eagle3", "plain"))
        row = {"concurrency": n, "eagle3": e, "plain": p,
               "speedup": e["output_tokens_per_s"] / p["output_tokens_per_s"]}  # fmt: skip
        if "repeats" in e:  # each interleaved pair's own ratio
            row["pair_speedups"] = [a["output_tokens_per_s"] / b["output_tokens_per_s"]
                                    for a, b in zip(e["repeats"], p["repeats"])]  # fmt: skip
        table.append(row)
    return {
        "bench": args.bench, "requests": args.requests, "max_tokens": args.max_tokens,
        "serve_args": args.serve_args, "tree_by_occupancy": args.tree_by_occupancy,
        "in_process": args.in_process,
        "alone": {k: ref[k] if k == "speedup" else {x: y for x, y in ref[k].items()
                                                   if x != "output_ids"}
                  for k in ("eagle3", "vanilla", "speedup")},
        "table": table, "runs": runs,
    }  # fmt: skip


def print_table(result: dict) -> None:
    a = result["alone"]
    print(
        f"decoding alone (batch 1): EAGLE-3 {a['eagle3']['output_tokens_per_s']:.1f} tok/s, "
        f"plain {a['vanilla']['output_tokens_per_s']:.1f} tok/s, speedup {a['speedup']:.2f}x"
    )
    print(
        "| concurrency | method | tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | τ "
        "| greedy = alone | speedup |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in result["table"]:
        for k in ("eagle3", "plain"):
            s = row[k]
            sp = f"**{row['speedup']:.2f}×**" if k == "eagle3" else ""
            if k == "eagle3" and row.get("pair_speedups"):
                sp += " (" + " / ".join(f"{x:.2f}" for x in row["pair_speedups"]) + ")"
            print(
                f"| {row['concurrency']} | {'EAGLE-3' if k == 'eagle3' else 'plain'} "
                f"| {s['output_tokens_per_s']:.1f} "
                f"| {s['ttft_s']['p50']:.2f} / {s['ttft_s']['p99']:.2f} "
                f"| {1e3 * s['tpot_s']['p50']:.0f} / {1e3 * s['tpot_s']['p99']:.0f} "
                f"| {s['tau']:.2f} | {s['equal_to_alone']}/{s['requests']} | {sp} |"
            )


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
    p.add_argument("--sweep", action="store_true",
                   help="start the servers itself (EAGLE-3 and plain rounds side by side), "
                   "closed loop")  # fmt: skip
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--serve-args", default="--slots 4", help="serve's flags for --sweep")
    p.add_argument("--tree-by-occupancy", default=None, help="the EAGLE-3 server's schedule")
    p.add_argument("--repeats", type=int, default=1,
                   help="--sweep: each level run this many times by each server or engine, "
                   "interleaved (A B, B A, ...)")  # fmt: skip
    p.add_argument("--in-process", action="store_true",
                   help="--sweep without HTTP: the same engine and scheduler driven in this "
                   "process (no fastapi, uvicorn or openai needed: the device step)")  # fmt: skip
    args = p.parse_args(argv)
    if args.sweep:
        result = sweep(args)
        print_table(result)
        if args.out:  # compact: every request's token ids, not its text
            for run in result["runs"].values():
                for level in run["levels"]:
                    for r in level["requests"]:
                        r.pop("text", None)
            Path(args.out).write_text(json.dumps(result, separators=(",", ":")) + "\n")
        return 0
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
