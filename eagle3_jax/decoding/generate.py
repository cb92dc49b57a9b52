"""One entry point for every decoding method: text or token prompts in, a typed `Generation` out.

`generate(target, prompts, head=...)` runs EAGLE-3 (the head's draft tree, verified by the target
in one pass a round); `method="pld"` prompt lookup; `method="vanilla"` plain decoding. Greedy
output is the same for every method (float32), sampled output has the target's distribution.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from eagle3_jax.checkpoints import Target
from eagle3_jax.checkpoints.heads import Head
from eagle3_jax.config import TreeConfig, default_tree
from eagle3_jax.decoding import plain
from eagle3_jax.decoding import speculative as spec
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.prompts import encode_chat

METHODS = ("eagle3", "pld", "vanilla")


@dataclasses.dataclass(frozen=True)
class Generation:
    """What one `generate` call produced, row by row (B prompts).

    output_ids: B lists of new token ids; texts: their decoded text; finish_reasons: "eos",
    "max_tokens" or "context"; target_forwards: B target passes, the prefill's included;
    accept_hist: [B, depth + 1] rounds by accepted draft tokens (None for vanilla).
    """

    method: str
    output_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    target_forwards: list[int]
    wall_time_s: float
    accept_hist: np.ndarray | None = None

    @property
    def tau(self) -> float:
        """Tokens per verification round over all rows, the bonus token included and the
        prefill's token and pass excluded (1.0 for vanilla)."""
        gens = len(self.output_ids)
        tokens = sum(len(o) for o in self.output_ids) - gens
        rounds = sum(self.target_forwards) - gens
        return tokens / rounds if rounds > 0 else float("nan")

    @property
    def acceptance_rates(self) -> list[float]:
        """alpha_d = P(accept >= d+1 | accept >= d) per draft depth d (empty for vanilla)."""
        return [] if self.accept_hist is None else spec.acceptance_rates(self.accept_hist)


def encode(target: Target, prompts: Sequence[str | Sequence[int]], chat_template=True):
    """Token ids of each prompt: a string goes through the target's chat template as one user
    turn, a list of ints is taken as is."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            if target.tokenizer is None:
                raise Eagle3Error("text prompts need the target's tokenizer: load it with one")
            out.append(
                encode_chat(target.tokenizer, [{"role": "user", "content": p}], chat_template)
            )
        else:
            out.append([int(i) for i in p])
    if not out or any(not ids for ids in out):
        raise Eagle3Error("give at least one non-empty prompt")
    return out


def generate(
    target: Target,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int = 128,
    head: Head | None = None,
    method: str | None = None,
    tree: TreeConfig | None = None,
    sampling: Sampling = Sampling(),
    seed: int = 0,
    chat_template: bool = True,
    max_context: int | None = None,
) -> Generation:
    """Decodes B prompts with `method` ("eagle3" when a head is given, else "vanilla").

    Args:
      target: a loaded target (`load_target`); its params may be sharded on a mesh.
      prompts: B strings (chat-templated) or B lists of token ids.
      head: a loaded head (`load_head`), needed by "eagle3".
      tree: the draft tree (default: the backend's, `default_tree`).
    Returns:
      a `Generation` (output ids and texts, finish reasons, target passes, tau, acceptance).
    """
    method = method or ("eagle3" if head is not None else "vanilla")
    if method not in METHODS:
        raise Eagle3Error(f"method {method!r}: use one of {', '.join(METHODS)}")
    if method == "eagle3" and head is None:
        raise Eagle3Error("method eagle3 needs a head: load one with load_head")
    if max_new_tokens < 1:
        raise Eagle3Error(f"max_new_tokens {max_new_tokens}: give 1 or more")
    ids = encode(target, prompts, chat_template)
    eos = tuple(target.cfg.eos_token_ids)
    if method == "vanilla":
        res = plain.generate(target.params, target.cfg, ids, max_new_tokens, sampling, seed, eos,
                             max_context)  # fmt: skip
        forwards = [len(o) for o in res.output_ids]
        hist = None
    else:
        h = head if method == "eagle3" else Head(None, None, None, None)
        res = spec.generate(
            target.params, target.cfg, h.params, h.cfg, h.vocab, ids, max_new_tokens,
            tree or default_tree(), sampling, seed, eos, max_context, embed=h.embed,
            method=method,
        )  # fmt: skip
        forwards, hist = list(res.target_forwards), np.asarray(res.accept_hist)
    texts = (
        [target.tokenizer.decode(o, skip_special_tokens=True) for o in res.output_ids]
        if target.tokenizer is not None
        else [""] * len(ids)
    )
    return Generation(method, res.output_ids, texts, list(res.finish_reasons), forwards,
                      float(res.wall_time_s), hist)  # fmt: skip
