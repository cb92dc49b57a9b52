"""Generate with a target model: plain, prompt lookup, or EAGLE-3 speculative decoding.

  python -m eagle3_jax decode --prompt "Explain speculative decoding in two sentences." \
      --compare-plain
  python -m eagle3_jax decode --method eagle3 --draft heads/my_head --top-k 4 --depth 4 --total-tokens 16
  python -m eagle3_jax decode --target ~/ckpt/Llama-3.1-8B-Instruct --prompt-file questions.jsonl \
      --json out.json
  python -m eagle3_jax decode --chat

Every flag's default runs on the embedded SmolLM2-135M-Instruct with its shipped EAGLE-3 head. See
docs/cli.md for the --json schema. `python decode.py` (the checkout's script) is the same command.
Several processes (a pod slice, a SLURM job) run the same command with --mesh DATAxMODEL over all
their devices and decode each batch together; process 0 prints and writes (docs/multihost.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from eagle3_jax import backends, compile_cache, cpu_tuning, distributed
from eagle3_jax.checkpoints import Target, load_target
from eagle3_jax.checkpoints.atomic import write_text_atomic
from eagle3_jax.checkpoints.heads import Head, load_head
from eagle3_jax.cli import decode_flags
from eagle3_jax.config import ProductPolicy, default_dtype
from eagle3_jax.decoding.generate import DecodeOptions, Generation, generate_ids, stream_ids
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation import metrics
from eagle3_jax.prompts import Prompt, encode_chat
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


def write_records(path: str | Path, records: list[dict]) -> None:
    """A JSON list, one record per line (easy to read and to diff), replaced atomically."""
    write_text_atomic(path, "[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]\n")


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

    head = load_head(
        args.draft, target, default_dtype(args.dtype), decode_flags.draft_vocab(args), mesh
    )
    if getattr(args, "spec_candidates", None):
        if not head.cfg.speculator_rank:
            raise Eagle3Error("--spec-candidates applies to SpecVocab heads only")
        head = head._replace(
            cfg=dataclasses.replace(head.cfg, spec_candidates=args.spec_candidates)
        )
    return head


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
    # the few-row products for the target and so the head; on accelerators, fused projections
    target = backends.prepare_target(target, _products(), mesh=mesh)
    head = load_draft_for(args, target, mesh)
    max_context = args.max_context or target.cfg.max_position_embeddings
    if max_context > target.cfg.max_position_embeddings:
        raise Eagle3Error(
            f"--max-context {max_context} is more than {target.path} holds "
            f"({target.cfg.max_position_embeddings} positions): give at most that"
        )
    if distributed.is_primary():
        print(f"loaded {_what(args, target, head)} in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr)  # fmt: skip
    return target, head, max_context


def _what(args, target: Target, head: Head | None) -> str:
    """The target and head loaded, as the line after the load names them."""
    what = f"{target.path} ({target.cfg.family}, {target.cfg.num_layers} layers)"
    if head is None:
        return what
    vd = head.cfg.draft_vocab_size
    whole = json.loads((Path(args.draft) / "config.json").read_text()).get("draft_vocab_size")
    cut = f" of its {whole}, --draft-vocab {decode_flags.draft_vocab(args)}"
    return f"{what} + draft {args.draft} (Vd {vd}{cut if whole and whole != vd else ''})"


def _decode(args) -> int:
    prompts = decode_flags.read_prompts(args)
    target, head, max_context = _load(args)
    opts = decode_flags.decode_options(args, max_context)
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
    if (
        "verified_per_round" in rec
        and args.method == "eagle3"
        and decode_flags.tree_of(args).verify_threshold > 0
    ):
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
    """decode's flags (decode_flags.py), with this module's usage atop --help."""
    return decode_flags.parse_args(argv, __doc__)


def main(argv=None) -> int:
    return decode_main(parse_args(argv))
