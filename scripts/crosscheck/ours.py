"""Our side: the engine's own rounds (`stream_ids`) on the same prompts, head and tree."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def run_ours(args, head: Path, prompt_texts: list[tuple[str, str]]):
    """(prompts as {id, text, ids}, our per-prompt runs, metadata)."""
    import jax
    import jax.numpy as jnp

    from eagle3_jax import compile_cache
    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.checkpoints.heads import load_head
    from eagle3_jax.decoding.generate import DecodeOptions, stream_ids
    from eagle3_jax.decoding.tree import TreeConfig
    from eagle3_jax.prompts import encode_chat

    compile_cache.enable()
    t0 = time.perf_counter()
    target = load_target(args.target_hf, dtype=jnp.float32)
    loaded = load_head(str(head), target, jnp.float32, "full")
    dcfg = loaded.cfg
    print(f"ours: loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    tree = TreeConfig(top_k=args.top_k, depth=args.depth, total_tokens=args.total_tokens)
    tree = tree.validate(dcfg.draft_vocab_size)
    opts = DecodeOptions("eagle3", args.max_new_tokens, tree)
    eos = tuple(target.cfg.eos_token_ids)
    prompts, runs = [], []
    for pid, text in prompt_texts:
        ids = encode_chat(target.tokenizer, [{"role": "user", "content": text}])
        prompts.append({"id": pid, "text": text, "ids": ids})
        chunks, t0 = [], time.perf_counter()
        for chunk in stream_ids(target, loaded, ids, opts):
            chunks.append(chunk)
        wall = time.perf_counter() - t0
        tokens = [t for c in chunks for t in c]
        emitted = [len(c) for c in chunks[1:]]
        cut = len(tokens) >= args.max_new_tokens or (bool(tokens) and tokens[-1] in eos)
        print(
            f"ours: {pid}: {len(tokens)} tokens in {len(emitted)} rounds, {wall:.1f}s "
            "(compiling included on the first prompt)",
            file=sys.stderr,
            flush=True,
        )
        runs.append({"tokens": tokens, "emitted": emitted, "cut": cut, "wall_s": wall})
    meta = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "eos_token_ids": list(eos),
        "draft_vocab_size": dcfg.draft_vocab_size,
        "aux_layer_ids": list(dcfg.aux_layer_ids),
        "tree": {"top_k": tree.top_k, "depth": tree.depth, "total_tokens": tree.total_tokens},
    }
    return prompts, runs, meta, target.tokenizer
