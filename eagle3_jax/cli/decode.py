"""Generate with a target model: plain, prompt lookup, or EAGLE-3 speculative decoding.

  python -m eagle3_jax decode --prompt "Explain speculative decoding in two sentences." \
      --compare-plain
  python -m eagle3_jax decode --method eagle3 --draft heads/my_head --top-k 4 --depth 4 --total-tokens 16
  python -m eagle3_jax decode --target ~/ckpt/Llama-3.1-8B-Instruct --prompt-file questions.jsonl \
      --json out.json
  python -m eagle3_jax decode --chat

Every flag's default runs on the embedded SmolLM2-135M-Instruct with its shipped EAGLE-3 head. See
docs/cli.md for the --json schema. `python decode.py` (the checkout's script) is the same command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from eagle3_jax import compile_cache, cpu_tuning, distributed
from eagle3_jax.checkpoints import Target, load_target
from eagle3_jax.checkpoints.atomic import write_text_atomic
from eagle3_jax.checkpoints.heads import Head, load_head, parse_draft_vocab
from eagle3_jax.config import ProductPolicy, default_dtype, default_tree
from eagle3_jax.decoding.generate import DecodeOptions, Generation, generate_ids, stream_ids
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation import metrics
from eagle3_jax.heads import default_head
from eagle3_jax.prompts import Prompt, encode_chat, read_prompt_file
from eagle3_jax.sharding import parse_mesh


def _messages(text: str, system: str | None) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": text}]


def _batches(items, n):
    for i in range(0, len(items), n):
        yield items[i : i + n]


def decode_main(args) -> int:

    compile_cache.enable()
    try:
        distributed.initialize()  # a pod / SLURM / multi-process job: join it first
        return _decode(args)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def check_settings(args) -> None:
    """Every numeric flag finite and in range, and the --json path writable, before any work."""
    for name in ("temperature", "top_p", "verify_threshold"):
        v = getattr(args, name, None)
        if v is not None and not math.isfinite(v):
            raise Eagle3Error(f"--{name.replace('_', '-')} {v}: give a finite number")
    v = getattr(args, "verify_threshold", None)
    if v is not None and not 0.0 <= v <= 1.0:
        raise Eagle3Error(f"--verify-threshold {v}: give a probability in [0, 1]")
    for name in ("max_new_tokens", "batch_size", "timing_runs"):
        if getattr(args, name, 1) < 1:
            raise Eagle3Error(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    if args.max_context is not None and args.max_context < 2:
        raise Eagle3Error(f"--max-context {args.max_context}: give 2 or more positions")
    if args.json:  # process 0 writes it, so checks it; the others get its error
        distributed.from_primary("decode: --json", lambda: check_writable(args.json, "--json"))


def check_writable(path: str | Path, what: str) -> None:
    """Refuses an output file that cannot be written, before the work that would fill it."""
    path = Path(path)
    if path.is_dir():
        raise Eagle3Error(f"{what} {path} is a directory: give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise Eagle3Error(f"{what} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise Eagle3Error(f"{what} {path} cannot be written here (permissions)")


def write_records(path: str | Path, records: list[dict]) -> None:
    """A JSON list, one record per line (easy to read and to diff), replaced atomically."""
    write_text_atomic(path, "[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]\n")


def resolve_method(args) -> None:
    """Fills --method / --draft defaults: the embedded target decodes with its shipped head."""
    if args.method is None:
        args.method = "eagle3" if args.draft or args.target is None else "vanilla"
    if args.method == "eagle3" and not args.draft and args.target is None:
        args.draft = str(default_head())


def _draft_vocab(args):
    """--draft-vocab parsed: "auto" (also when the namespace has no such flag), "full" or N."""

    return parse_draft_vocab(getattr(args, "draft_vocab", None) or "auto")


def load_draft_for(args, target, mesh=None) -> Head | None:
    """--draft PATH -> its `Head`, checked against the target before any compute (None for a
    method that drafts without one)."""
    if args.method != "eagle3":
        return None
    if not args.draft:
        raise Eagle3Error(
            "--method eagle3 needs --draft PATH (an EAGLE-3 head: config.json + "
            "model.safetensors), or use --method vanilla / pld"
        )

    head = load_head(args.draft, target, default_dtype(args.dtype), _draft_vocab(args), mesh)
    if getattr(args, "spec_candidates", None):
        if not head.cfg.speculator_rank:
            raise Eagle3Error("--spec-candidates applies to SpecVocab heads only")
        head = head._replace(
            cfg=dataclasses.replace(head.cfg, spec_candidates=args.spec_candidates)
        )
    return head


def _tree(args):
    """The tree from --top-k/--depth/--total-tokens/--verify-threshold, each unset one from the
    backend's default (`default_tree`: a small adaptive tree on the CPU, EAGLE-3's
    60-token tree on accelerators)."""

    return default_tree(
        top_k=getattr(args, "top_k", None),
        depth=getattr(args, "depth", None),
        total_tokens=getattr(args, "total_tokens", None),
        verify_threshold=getattr(args, "verify_threshold", None),
    )


def _check_tree(args) -> None:
    """The tree's shape, checked; an error says which flags were left to the backend's default."""

    try:
        _tree(args).validate(10**9)
    except Eagle3Error as e:
        fields = ("top_k", "depth", "total_tokens")
        unset = [f"--{f.replace('_', '-')}" for f in fields if getattr(args, f, None) is None]
        if not unset:
            raise
        d = default_tree()
        raise Eagle3Error(
            f"{e}; unset, {' '.join(unset)} took this backend's default tree (--top-k {d.top_k} "
            f"--depth {d.depth} --total-tokens {d.total_tokens}): give them too"
        ) from None


def decode_options(args, max_context: int) -> DecodeOptions:
    """The flags as the one `DecodeOptions` every batch and the chat decode with."""
    return DecodeOptions(
        method=args.method,
        max_new_tokens=args.max_new_tokens,
        tree=_tree(args),
        sampling=Sampling(args.temperature, args.sample_top_k, args.top_p),
        seed=args.seed,
        max_context=max_context,
        same_engine=args.same_engine,
    )


def _prompts(args) -> list[Prompt]:
    """The flags checked (before the slow load) and the prompts they name (none for --chat)."""
    if args.batch_size < 1:
        raise Eagle3Error(f"--batch-size {args.batch_size} < 1")
    if args.timing_runs < 1:
        raise Eagle3Error(f"--timing-runs {args.timing_runs} < 1")
    resolve_method(args)
    if args.compare_plain and (args.method == "vanilla" or args.chat):
        raise Eagle3Error("--compare-plain compares eagle3/pld with plain decoding, not in --chat")
    if args.chat and jax.process_count() > 1:
        raise Eagle3Error(
            f"--chat reads this terminal: run it as one process ({jax.process_count()} joined)"
        )
    check_settings(args)
    Sampling(args.temperature, args.sample_top_k, args.top_p)  # its errors before the load too
    if args.method != "vanilla":
        _check_tree(args)  # shape errors before the (slow) load; Vd is checked later
    if args.method == "eagle3":
        _draft_vocab(args)  # its errors before the (slow) load, too
    if args.prompt_file:
        prompts = read_prompt_file(args.prompt_file)
    elif args.prompt:
        prompts = [Prompt(str(i), t) for i, t in enumerate(args.prompt)]
    elif args.chat:
        prompts = []
    else:
        prompts = [Prompt("0", "What is speculative decoding? Answer in three sentences.")]
    for p in prompts:
        if not p.text.strip():
            raise Eagle3Error(f"prompt {p.id} is empty: give some text")
    return prompts


def _mesh(text: str | None):
    """--mesh as a mesh; on several processes it must span every process's devices, over which
    they decode each batch together."""
    mesh = parse_mesh(text)
    n, devices = jax.process_count(), jax.device_count()
    if n > 1 and (mesh is None or mesh.size != devices):
        given = f"--mesh {text} covers {mesh.size}" if mesh is not None else "no --mesh uses one"
        raise Eagle3Error(
            f"{given} of the {devices} devices of {n} processes: give --mesh DATAxMODEL over "
            f"all of them (DATA x MODEL = {devices}, MODEL at most one process's "
            f"{jax.local_device_count()})"
        )
    return mesh


def _products():
    """This machine's few-row products (measured once per CPU); on several processes process
    0's, so that every process compiles the same programs."""
    fields = distributed.from_primary(
        "decode: products", lambda: dataclasses.asdict(cpu_tuning.policy_for())
    )
    return ProductPolicy(**fields)


def _load(args) -> tuple[Target, Head | None, int]:
    """The target (with this machine's few-row products), the head, and the context limit."""
    mesh = _mesh(getattr(args, "mesh", None))
    t0 = time.perf_counter()
    target = load_target(args.target, dtype=default_dtype(args.dtype), mesh=mesh)
    # the few-row products for the target and so the head
    products = _products()
    target = target._replace(cfg=dataclasses.replace(target.cfg, products=products))
    head = load_draft_for(args, target, mesh)
    max_context = args.max_context or target.cfg.max_position_embeddings
    if max_context > target.cfg.max_position_embeddings:
        raise Eagle3Error(
            f"--max-context {max_context} is more than {target.path} holds "
            f"({target.cfg.max_position_embeddings} positions): give at most that"
        )
    what = ""
    if head is not None:
        vd = head.cfg.draft_vocab_size
        whole = json.loads((Path(args.draft) / "config.json").read_text()).get("draft_vocab_size")
        cut = (
            f" of its {whole}, --draft-vocab {_draft_vocab(args)}" if whole and whole != vd else ""
        )
        what = f" + draft {args.draft} (Vd {vd}{cut})"
    if distributed.is_primary():
        print(
            f"loaded {target.path} ({target.cfg.family}, {target.cfg.num_layers} layers){what} "
            f"in {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
        )
    return target, head, max_context


def _decode(args) -> int:
    prompts = _prompts(args)
    target, head, max_context = _load(args)
    opts = decode_options(args, max_context)
    encode = lambda msgs: encode_chat(target.tokenizer, msgs, not args.no_chat_template)  # noqa
    if args.chat:
        return _chat(args, target, head, encode, opts)
    records, primary = [], distributed.is_primary()  # every process decodes, process 0 tells
    for batch in _batches(prompts, args.batch_size):
        ids = [encode(_messages(p.text, args.system)) for p in batch]
        runs = _run_batch(args, target, head, opts, ids, first=not records)
        for i, (p, pids) in enumerate(zip(batch, ids)):
            rec = _record(args, p, pids, runs, i)
            records.append(rec)
            if not primary:
                continue
            if args.json:  # as they come: an interrupted run keeps the prompts it finished
                write_records(args.json, records)
            _show(args, p, rec, runs, i, len(batch), target)
    if args.json and primary:
        write_records(args.json, records)
        print(f"wrote {len(records)} records to {args.json}", file=sys.stderr)
    return 0


class _Runs(NamedTuple):
    """A batch's generation and median wall time over --timing-runs, and plain decoding's
    (--compare-plain; else None)."""

    gen: Generation
    wall: float
    plain: Generation | None
    plain_wall: float | None
    count: int


def _run_batch(args, target, head, opts: DecodeOptions, ids, first: bool) -> _Runs:
    """--timing-runs N: the batch N times, the methods alternating so they see the same machine;
    the median wall time of each (outputs do not change: same seed, same programs). Only the
    first batch's first run warms up (compiles) first, unless --no-warmup."""
    plain_opts = dataclasses.replace(opts, method="vanilla", same_engine=False)
    walls, plain_walls, plain = [], [], None
    for rep in range(args.timing_runs):
        warm = first and rep == 0
        gen = generate_ids(target, head, ids, opts, warmup=not args.no_warmup and warm)
        walls.append(gen.wall_time_s)
        if args.compare_plain:
            plain = generate_ids(target, None, ids, plain_opts, warmup=warm)
            plain_walls.append(plain.wall_time_s)
    plain_wall = float(np.median(plain_walls)) if plain_walls else None
    return _Runs(gen, float(np.median(walls)), plain, plain_wall, len(walls))


def _record(args, p: Prompt, pids: list[int], runs: _Runs, i: int) -> dict:
    """Row i of the batch as its --json record."""
    row, wall = runs.gen.rows()[i], runs.wall
    out = row.output_ids
    rec = {
        "id": p.id,
        "method": args.method,
        "prompt_ids": pids,
        "output_ids": out,
        "text": row.text,
        "new_tokens": len(out),
        "target_forwards": row.target_forwards,
        "wall_time_s": wall,
        "finish_reason": row.finish_reason,
        "tokens_per_s": len(out) / wall,
        "tau": row.tau,
    }
    if row.verified_tokens is not None and row.target_forwards > 1:
        rec["verified_per_round"] = row.verified_tokens / (row.target_forwards - 1)
    if row.accept_hist is not None:
        rec["accept_hist"] = row.accept_hist
        rec["acceptance_by_depth"] = metrics.acceptance_rates(np.asarray(row.accept_hist))
    if runs.plain is not None:
        plain_out = runs.plain.output_ids[i]
        rec["plain_tokens_per_s"] = len(plain_out) / runs.plain_wall
        rec["plain_wall_time_s"] = runs.plain_wall
        rec["speedup"] = rec["tokens_per_s"] / rec["plain_tokens_per_s"]
        rec["identical_to_plain"] = plain_out == out
    return rec


def _show(args, p: Prompt, rec: dict, runs: _Runs, i: int, batch: int, target) -> None:
    """Row i's text and figures on stdout (and how it compares with plain decoding)."""
    extra = ""
    if "acceptance_by_depth" in rec:
        extra = " alpha by depth " + " ".join(f"{a:.2f}" for a in rec["acceptance_by_depth"])
    if "verified_per_round" in rec and args.method == "eagle3" and _tree(args).verify_threshold > 0:
        extra += f", {rec['verified_per_round']:.2f} tokens verified per round"
    times = f", median of {runs.count} runs" if runs.count > 1 else ""
    print(
        f"### [{p.id}] {p.text[:80]}\n{rec['text']}\n"
        f"--- {args.method}: {rec['new_tokens']} tokens in {runs.wall:.2f}s = "
        f"{rec['tokens_per_s']:.1f} tokens/s, tau {rec['tau']:.2f}{extra} "
        f"(batch {batch}, {rec['finish_reason']}{times})"
    )
    if runs.plain is not None:
        same = "identical" if rec["identical_to_plain"] else "DIFFERENT"
        if args.temperature > 0:
            same += " (sampling: outputs differ by design)"
        elif not rec["identical_to_plain"]:
            same += _why_different(runs.plain.output_ids[i], rec["output_ids"], target)
        print(
            f"--- plain: {rec['plain_tokens_per_s']:.1f} tokens/s in the same run -> "
            f"speedup {rec['speedup']:.2f}x, outputs {same}"
        )
    print()


def _why_different(plain_out: list[int], out: list[int], target) -> str:
    """Where greedy outputs part, and why that can happen below fp32."""
    at = metrics.common_prefix(plain_out, out)
    dtype = jax.tree.leaves(target.params)[0].dtype
    why = f" from new token {at} (0-based)"
    if dtype != np.float32:
        why += (
            f" ({dtype.name} parameters: a verification sums over several tokens in another "
            "order than a decode step over one, and each rounding to "
            f"{dtype.name} can turn that into a logit difference that flips a near-tie; exact in "
            "float32: --dtype float32; BENCHMARKS.md, 'Exactness in bfloat16')"
        )
    return why


def _chat(args, target, head, encode, opts: DecodeOptions) -> int:
    # plain decoding's own loop for vanilla, --same-engine or not (one token a step)
    opts = dataclasses.replace(opts, same_engine=False) if opts.method == "vanilla" else opts
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("chat: type a message, empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        history.append({"role": "user", "content": line})
        out, shown, rounds, t0 = [], "", 0, time.perf_counter()
        try:
            for chunk in stream_ids(target, head, encode(history), opts):
                rounds += 1
                out.extend(chunk)
                text = target.tokenizer.decode(out, skip_special_tokens=True)
                print(text[len(shown) :], end="", flush=True)
                shown = text
        except Eagle3Error as e:  # e.g. the conversation outgrew the context: say so, keep chatting
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        dt = time.perf_counter() - t0
        tau = metrics.tau_of(len(out), rounds, no_round=1.0)
        print(
            f"\n[{len(out)} tokens, {len(out) / dt:.1f} tokens/s, tau {tau:.2f}]", file=sys.stderr
        )
        history.append({"role": "assistant", "content": shown})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--target",
        default=None,
        help="transformers checkpoint dir, .gguf file or eagle3_jax converted dir "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--method",
        default=None,
        choices=["eagle3", "pld", "vanilla"],
        help="eagle3: draft tree from --draft; pld: prompt lookup chain; vanilla: plain "
        "(default: eagle3 with --draft or on the embedded default target, else vanilla)",
    )
    p.add_argument(
        "--draft",
        default=None,
        help="EAGLE-3 head directory in the official format (config.json + safetensors); "
        "default on the embedded target: the head shipped in eagle3_jax/heads",
    )
    p.add_argument(
        "--draft-vocab",
        default="auto",
        metavar="auto|full|N",
        help="draft ids the head proposes from: full (all), N (the first N its vocab_order.json "
        "lists: a smaller output layer, cheaper rounds on a CPU) or auto (default: on the CPU "
        "the size its vocab_order.json names, if any, else all; the shipped head: 8,192 of "
        "16,384 on the CPU)",
    )
    p.add_argument(
        "--compare-plain",
        action="store_true",
        help="also decode each batch plainly and report the speedup and whether outputs match",
    )
    # Unset tree flags come from the backend's default (eagle3_jax.decoding.default_tree):
    # on the CPU the best shape measured with the Vd 8,192 GPU head (4 nodes, the 2 best tokens at each
    # depth, 3 deep, verify threshold 0.3); on GPUs/TPUs, where verifying more tokens is nearly free,
    # EAGLE-3's reporting tree (top-k 10, depth 8 = EAGLE's 7, 60 tokens). See BENCHMARKS.md.
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="children per expanded tree node (1 = a chain); default 2 on the CPU, 10 elsewhere",
    )
    p.add_argument(
        "--depth",
        type=int,
        default=None,
        help="max drafted tokens per path (pld: chain length); default 3 on the CPU, 8 elsewhere",
    )
    p.add_argument(
        "--total-tokens",
        type=int,
        default=None,
        help="tree nodes verified per round, root included; default 4 on the CPU, 60 elsewhere "
        "(capped at what --top-k and --depth hold: --top-k 1 alone is a chain)",
    )
    p.add_argument(
        "--verify-threshold",
        type=float,
        default=None,
        help="adaptive verification: verify only the nodes whose cumulative draft probability is "
        "at least this (rounded up to a compiled size: 1, 2, 4, ..., total), and skip draft levels "
        "none could pass; 0 = every node every round. Default: 0.3 on the CPU, where verifying "
        "costs (docs/cli.md), 0 on accelerators",
    )
    p.add_argument(
        "--spec-candidates",
        type=int,
        default=None,
        help="SpecVocab heads: exact-logit candidates per drafted row (default: the head's, 2048)",
    )
    p.add_argument(
        "--same-engine",
        action="store_true",
        help="run vanilla through the speculative engine's verification step",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="a user message (repeatable)")
    src.add_argument(
        "--prompt-file", help="one prompt per line, or FastChat/Spec-Bench JSONL (first turn)"
    )
    src.add_argument("--chat", action="store_true", help="interactive chat with streamed output")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument(
        "--sample-top-k", type=int, default=0, help="sampling: keep the k most likely (0 = off)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus mass (1.0 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="context limit in tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--mesh",
        default=None,
        help="DATAxMODEL devices (e.g. 1x8): the target and head tensor-parallel over MODEL, the "
        "batch over DATA (default: one device)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="parameter dtype (default: float32 on CPU, bfloat16 on GPU/TPU)",
    )
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text")
    p.add_argument("--system", default=None, help="system message (default: the template's own)")
    p.add_argument("--json", default=None, help="write one record per prompt to this file")
    p.add_argument(
        "--timing-runs",
        type=int,
        default=1,
        help="run each batch N times (with --compare-plain alternating with plain decoding) and "
        "report the median wall time: a steadier speedup on a noisy machine",
    )
    p.add_argument(
        "--no-warmup", action="store_true", help="time the first batch including compilation"
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    return decode_main(parse_args(argv))
