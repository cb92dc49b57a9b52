"""Convert an EAGLE-3 head between the published layouts (docs/interop.md).

  python -m eagle3_jax export --draft HEAD --out OUT                      # official layout
  python -m eagle3_jax export --draft HEAD --out OUT --layout speculators \\
      --verifier HuggingFaceTB/SmolLM2-135M-Instruct                       # vLLM's speculators

Reads any layout `load_draft` reads (official with or without `embed_tokens.weight`, SpecForge's,
speculators'), checks it against the target, and writes it again: the official layout as
SafeAILab/EAGLE, SpecForge, SGLang and vLLM load it (no `target_hidden_size` when the widths agree;
both aux-layer keys), or the speculators layout (`Eagle3Speculator`, `layers.0.*`, every flag
explicit). The tensors are the same values; only names and config keys change. Exit status 2 with
one line on bad input; OUT must be new, empty, or (with --overwrite) a head this project wrote.
"""

from __future__ import annotations

import argparse
import sys

from eagle3_jax.checkpoints import load_target_config
from eagle3_jax.checkpoints.atomic import check_destination
from eagle3_jax.checkpoints.eagle_format import load_draft, save_draft
from eagle3_jax.config import DTYPES, FAMILIES
from eagle3_jax.errors import Eagle3Error

DEFAULT_VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded default's hub name


def _arch_of(tcfg) -> str:

    return next(a for a, f in FAMILIES.items() if f == tcfg.family)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m eagle3_jax export",
        description="Convert an EAGLE-3 head between the official and vLLM speculators layouts.",
    )
    p.add_argument("--draft", required=True, help="the head directory to read (any layout)")
    p.add_argument("--out", required=True, help="the new head directory")
    p.add_argument("--layout", default="official", choices=["official", "speculators"])
    p.add_argument(
        "--target",
        default=None,
        help="the target the head runs on (default: the embedded SmolLM2); its config checks the "
        "head and names the verifier's architecture",
    )
    p.add_argument(
        "--verifier",
        default=None,
        help="speculators: the verifier's name_or_path as the serving machine finds it (default: "
        f"{DEFAULT_VERIFIER} for the embedded default, else --target)",
    )
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=3,
        help="speculators: the chain length vLLM drafts unless told otherwise (default 3)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument(
        "--overwrite", action="store_true", help="replace --out if it is a head eagle3_jax wrote"
    )
    args = p.parse_args(argv)
    try:
        if args.speculative_tokens < 1:
            raise Eagle3Error(f"--speculative-tokens {args.speculative_tokens}: give 1 or more")
        check_destination(args.out, args.overwrite, [args.draft], what="--out")
        tcfg = load_target_config(args.target)
        params, cfg, vocab, embed = load_draft(args.draft, tcfg)
        verifier = None
        if args.layout == "speculators":
            name = args.verifier or (DEFAULT_VERIFIER if args.target is None else args.target)
            verifier = (name, [_arch_of(tcfg)])
        save_draft(args.out, params, cfg, vocab, args.dtype, embed, args.overwrite, [args.draft],
                   layout=args.layout, verifier=verifier,
                   speculative_tokens=args.speculative_tokens)  # fmt: skip
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    own = "its own embedding" if embed is not None else "the target's embedding"
    print(
        f"wrote {args.out}: {args.layout} layout, Vd {cfg.draft_vocab_size}, aux layers "
        f"{cfg.aux_layer_ids} (hidden_states indices), {own}"
    )
    if cfg.final_norm_aux:
        print(
            f"note: aux id {max(cfg.aux_layer_ids)} is the target's final normed state "
            "(final_norm_aux): SGLang and vLLM never capture it, so only eagle3_jax runs this head"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
