"""An OpenAI-compatible server: continuous batching over fixed slots, a speculative round a step.

  python -m eagle3_jax serve                       # the embedded SmolLM2 + its head, port 8000
  python -m eagle3_jax serve --target ~/ckpt/Llama-3.1-8B-Instruct --draft heads/llama \
      --slots 8 --max-context 4096 --max-new-tokens 1024 --port 8000

Endpoints: POST /v1/completions and /v1/chat/completions (stream or not), GET /v1/models,
/health and /metrics. Each request samples as its own fields say (temperature, top_p, top_k,
seed; temperature 0 is greedy); --temperature, --top-p and --sample-top-k are the defaults.
--tree-by-occupancy picks each round's tree from the busy slots, down to plain rounds: by default
(auto) the faster of the tree flags' tree and plain rounds, measured per occupancy while serving;
or a table, --tree-by-occupancy "1-2:10/8/60,3-4:1/4/5,5-:plain" (RANGE:top_k/depth/total or plain)
docs/serving.md has the details and what is not served yet. SIGTERM (or Ctrl-C) stops taking
connections and lets running requests finish for --drain-timeout seconds.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import time

import jax

from eagle3_jax import compile_cache
from eagle3_jax.accelerators import predict
from eagle3_jax.cli import decode, decode_flags
from eagle3_jax.decoding.generate import DecodeOptions
from eagle3_jax.decoding.slots import PLAIN, MeasuredSchedule, SlotEngine, TreeSchedule, tree_name
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.serving.api import Server, build_app
from eagle3_jax.serving.scheduler import Scheduler


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eagle3_jax serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    decode_flags._model_flags(p)
    decode_flags._tree_flags(p)
    decode_flags._run_flags(p)
    decode_flags.prefill_flag(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=4, help="requests decoded together (default 4)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; more are answered 429")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=512,
                   help="the most tokens a request may ask for (its default too)")  # fmt: skip
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="a request's default temperature (0 = greedy); requests may set their own",
    )
    p.add_argument("--sample-top-k", type=int, default=0, help="a request's default top_k (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="a request's default top_p")
    decode_flags.add_penalty_flags(p, "a request's default: ")
    p.add_argument("--tree-by-occupancy", default="auto", metavar="SCHEDULE",
                   help="each round's tree by the number of busy slots. auto (the default): "
                   "measured while serving, per occupancy the fastest in tokens/s of the tree "
                   "flags' tree, plain rounds and, on a GPU or TPU the cost model knows, its best "
                   "tree for --slots (auto:TREE,TREE,... other candidates); a table such "
                   "as '1-2:10/8/60,3-4:1/4/5,5-:plain' (top_k/depth/total_tokens[/verify "
                   "threshold], or plain: the root alone; occupancies not listed use the tree "
                   "flags' tree); or fixed: the tree flags' tree every round. Logged when it "
                   "changes; /metrics has eagle3_tree_tokens and eagle3_tree_rounds_total{tree}")  # fmt: skip
    p.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                   help="keep each generated token's log-probability and its N most likely "
                   "alternatives, so requests may ask for logprobs (chat: logprobs, "
                   "top_logprobs <= N; completions: logprobs <= N); costs a log-softmax and a "
                   "top-N over the vocabulary per token every round (default: off)")  # fmt: skip
    p.add_argument("--round-rows", choices=("busy", "all"), default="busy",
                   help="the rows a round runs: the busy slots, padded with free ones to a power "
                   "of two (the default: a round's cost follows the occupancy), or all --slots")  # fmt: skip
    p.add_argument("--prefix-cache-mb", type=float, default=0.0, metavar="MB",
                   help="with --prefill-chunk: keep prompts' whole chunks (their K/V and "
                   "features) up to MB and restore those a new prompt begins with instead of "
                   "prefilling them again (a system prompt, a conversation's earlier turns); "
                   "answers unchanged (default 0: off)")  # fmt: skip
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: the target's folder name)")  # fmt: skip
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM")  # fmt: skip
    return p.parse_args(argv)


def check(args) -> None:
    """The flags' errors before the slow load."""
    decode_flags.resolve_method(args)
    for name in ("slots", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise Eagle3Error(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    if args.max_queue < 1:  # every request waits in the queue, if only until the next round
        raise Eagle3Error(f"--max-queue {args.max_queue}: give 1 or more")
    if args.max_logprobs is not None and not 0 <= args.max_logprobs <= 20:
        raise Eagle3Error(f"--max-logprobs {args.max_logprobs}: give 0..20")
    if not 0 < args.port < 65536:
        raise Eagle3Error(f"--port {args.port}: give 1..65535")
    mb = args.prefix_cache_mb
    if not (0 <= mb < 2**40) or mb and not args.prefill_chunk:  # nan and inf refused too
        raise Eagle3Error(f"--prefix-cache-mb {args.prefix_cache_mb}: give a size >= 0, with "
                          "--prefill-chunk C (the cache keeps whole chunks)")  # fmt: skip
    args.json, args.timing_runs, args.batch_size = None, 1, 1  # what check_settings reads
    decode_flags.check_settings(args)
    decode_flags.sampling_of(args)
    if args.method != "vanilla":
        decode_flags.check_tree(args)
    if args.method == "eagle3":
        decode_flags.draft_vocab(args)
    schedule_of(args.tree_by_occupancy, decode_flags.tree_of(args))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check(args)
        compile_cache.enable()
        log_to_stderr()
        target, head, max_context = decode._load(args)
        engine = build_engine(args, target, head, max_context)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn  # the serve extra; imported here so other commands never need it

    print(f"compiling the round for {args.slots} slots ...", file=sys.stderr)
    warm(engine)
    scheduler = Scheduler(engine, args.max_queue).start()
    name = args.served_model_name or (target.path.name if target.path else "eagle3_jax")
    app = build_app(Server(scheduler, target.tokenizer, name))
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            timeout_graceful_shutdown=int(args.drain_timeout))  # fmt: skip
    # uvicorn re-raises the signal that stopped it once it has shut down, under the handler it
    # found: with the default one SIGTERM would kill the process (exit -15) before the drain
    # below, so the handler it finds ignores it and main drains and returns 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        uvicorn.Server(config).run()  # returns after SIGTERM/SIGINT and the graceful shutdown
    finally:
        scheduler.drain(args.drain_timeout)
        scheduler.stop()
    return 0


def build_engine(args, target, head, max_context) -> SlotEngine:
    """The slot engine `serve` runs for these (checked) flags and the loaded models."""
    opts = DecodeOptions(
        args.method, args.max_new_tokens, decode_flags.tree_of(args),
        decode_flags.sampling_of(args),
        max_context=max_context, same_engine=True, prefill_chunk=args.prefill_chunk,
    )  # fmt: skip
    if args.method == "eagle3" and (args.tree_by_occupancy or "").strip() == "auto":
        dtype = jax.tree.leaves(target.params)[0].dtype
        schedule = MeasuredSchedule(
            auto_candidates(opts.tree, target.cfg, head[1], args.slots, max_context,
                            jax.devices()[0].device_kind, dtype.itemsize)
        )  # fmt: skip
    else:
        schedule = schedule_of(args.tree_by_occupancy, opts.tree)
    return SlotEngine(target, head, opts, args.slots, schedule, args.round_rows == "busy",
                      args.max_logprobs,
                      prefix_cache_bytes=int(args.prefix_cache_mb * 2**20))  # fmt: skip


def auto_candidates(tree, tcfg, dcfg, slots: int, context: int, device_kind: str,
                    dtype_bytes: int = 2) -> list:  # fmt: skip
    """`auto`'s candidates: the tree flags' tree and plain rounds, and on an accelerator the cost
    model has figures for (`accelerators.predict.device_spec`) its best tree for this target at
    `slots` rows and `context` cache slots (`predict.serving_tree`), logged."""
    dev = predict.device_spec(device_kind)
    if dev is None:
        return [tree, PLAIN]
    best = predict.serving_tree(dev, tcfg, dcfg, slots, context, dtype_bytes=dtype_bytes)
    logging.getLogger(__name__).info(
        "cost model (%s): %s at %d slots, predicted %.2fx over plain steps", dev.name,
        tree_name(best.tree), slots, best.speedup,
    )  # fmt: skip
    return list(dict.fromkeys([tree, best.tree, PLAIN]))


def log_to_stderr() -> None:
    """The package's INFO lines (the tree choices) on stderr: the root logger may already have a
    handler from a library imported earlier, which makes logging.basicConfig a no-op."""
    pkg = logging.getLogger("eagle3_jax")
    pkg.setLevel(logging.INFO)
    if not pkg.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
        pkg.addHandler(handler)
        pkg.propagate = False


def schedule_of(text: str | None, tree):
    """--tree-by-occupancy: measured (`auto`, `auto:TREE,...`), a table, or none (None or
    `fixed`: the tree flags' tree every round)."""
    if text is None or text.strip() == "fixed":
        return None
    if text.strip().startswith("auto"):
        if not re.fullmatch(r"auto(:.*)?", text.strip()):
            raise Eagle3Error(f"--tree-by-occupancy {text!r}: give auto or auto:TREE,TREE,...")
        return MeasuredSchedule.parse(text.strip(), tree)
    return TreeSchedule.parse(text, tree)


def warm(engine: SlotEngine) -> None:
    """Compiles every program before serving, ahead of time (the compilation cache keeps them
    for the next start): the admission of each prompt bucket (`SlotEngine.compile_admissions`),
    its scoring with --max-logprobs (`compile_scoring`: echo) and the round of each tree at
    each row bucket (`SlotEngine.compile_rounds`); then runs each round program once, with as
    many one-token requests as its rows: a program's first run costs ~0.3 s more than the next
    on a CPU, which a request would wait for and the measured tree choice would take for the
    tree's cost (the release's and the report's small programs run too)."""
    start = time.perf_counter()
    n = engine.compile_admissions()
    print(f"compiled {n} admission programs (prompts up to {engine.prompt_buckets()[-1]} "
          f"tokens) in {time.perf_counter() - start:.1f}s", file=sys.stderr)  # fmt: skip
    n = engine.compile_scoring()
    if n:
        print(f"compiled {n} prompt-scoring programs (echo with logprobs)", file=sys.stderr)
    start = time.perf_counter()
    n = engine.compile_rounds()
    print(f"compiled {n} round programs ({len(engine.schedule.trees())} trees x rows "
          f"{engine.row_buckets()}) in {time.perf_counter() - start:.1f}s", file=sys.stderr)  # fmt: skip
    room = min(engine.opts.max_new_tokens, engine.max_tokens_for(1))
    for rows in engine.row_buckets():
        for tree in engine.schedule.trees():
            while engine.busy() < rows:  # a row that ended (EOS, its room) is replaced
                engine.admit("warmup", [engine.pad], room)
            if engine.prefill_chunk:  # every row joins before the round of `rows` rows
                engine.prefill_some(everything=True)
            engine.step(tree)
        for slot in range(engine.slots):
            engine.release(slot)
    engine.current_tree = None
    engine.tree_rounds.clear()
    engine.rounds = 0
