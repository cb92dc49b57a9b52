"""Command-line plumbing shared by decode.py (and later train.py / eval): load, run, report."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from eagle3_jax.errors import Eagle3Error


def default_dtype(name: str | None):
    import jax
    import jax.numpy as jnp

    if name is None:
        name = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def _messages(text: str, system: str | None) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": text}]


def _batches(items, n):
    for i in range(0, len(items), n):
        yield items[i : i + n]


def decode_main(args) -> int:
    try:
        return _decode(args)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _decode(args) -> int:
    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.decoding import plain
    from eagle3_jax.decoding.sampling import Sampling
    from eagle3_jax.prompts import Prompt, encode_chat, read_prompt_file

    if args.batch_size < 1:
        raise Eagle3Error(f"--batch-size {args.batch_size} < 1")
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
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

    t0 = time.perf_counter()
    target = load_target(args.target, dtype=default_dtype(args.dtype))
    tok = target.tokenizer
    max_context = args.max_context or target.cfg.max_position_embeddings
    print(f"loaded {target.path} ({target.cfg.family}, {target.cfg.num_layers} layers) "
          f"in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    encode = (lambda msgs: encode_chat(tok, msgs, not args.no_chat_template))

    if args.chat:
        return _chat(args, target, encode, sampling, max_context)

    records = []
    for batch in _batches(prompts, args.batch_size):
        ids = [encode(_messages(p.text, args.system)) for p in batch]
        res = plain.generate(target.params, target.cfg, ids, args.max_new_tokens, sampling, args.seed,
                             max_context=max_context, pad_id=target.cfg.pad_token_id or 0,
                             warmup=not args.no_warmup and not records)
        for p, pids, out, reason in zip(batch, ids, res.output_ids, res.finish_reasons):
            text = tok.decode(out, skip_special_tokens=True)
            rec = {"id": p.id, "method": args.method, "prompt_ids": pids, "output_ids": out,
                   "text": text, "new_tokens": len(out), "target_forwards": len(out),
                   "wall_time_s": res.wall_time_s, "finish_reason": reason,
                   "tokens_per_s": len(out) / res.wall_time_s}
            records.append(rec)
            print(f"### [{p.id}] {p.text[:80]}\n{text}\n"
                  f"--- {len(out)} tokens in {res.wall_time_s:.2f}s = {rec['tokens_per_s']:.1f} tokens/s "
                  f"(batch {len(batch)}, {reason})\n")
    if args.json:
        # a JSON list, one record per line: easy to read and to diff
        Path(args.json).write_text("[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]\n")
        print(f"wrote {len(records)} records to {args.json}", file=sys.stderr)
    return 0


def _chat(args, target, encode, sampling, max_context) -> int:
    from eagle3_jax.decoding import plain

    tok = target.tokenizer
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
        ids = encode(history)
        out, shown, t0 = [], "", time.perf_counter()
        try:
            for t in plain.stream(target.params, target.cfg, ids, args.max_new_tokens, sampling,
                                  args.seed, max_context=max_context):
                out.append(t)
                text = tok.decode(out, skip_special_tokens=True)
                print(text[len(shown):], end="", flush=True)
                shown = text
        except Eagle3Error as e:  # e.g. the conversation outgrew the context: say so, keep chatting
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        dt = time.perf_counter() - t0
        print(f"\n[{len(out)} tokens, {len(out) / dt:.1f} tokens/s]", file=sys.stderr)
        history.append({"role": "assistant", "content": shown})
