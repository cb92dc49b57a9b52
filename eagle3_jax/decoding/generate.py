"""One entry point for every decoding method: prompts in, a typed `Generation` out.

`generate(target, prompts, head=...)` (the public API) runs EAGLE-3 (the head's draft tree,
verified by the target in one pass a round); `method="pld"` prompt lookup; `method="vanilla"`
plain decoding. Greedy output is the same for every method (float32), sampled output has the
target's distribution.

Under it, `generate_ids(target, head, prompts, options)` takes token ids and one `DecodeOptions`
and is the one place a method is dispatched: plain decoding's loop for vanilla, else the
speculative engine (speculative.py) with the method's drafter. decode.py, the harness (and the
ablation runner through it), the benchmarks and the tests call it; `stream_ids` takes the same
options and yields one prompt's tokens round by round (chat).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from eagle3_jax import distributed
from eagle3_jax.checkpoints import Target
from eagle3_jax.checkpoints.heads import Head
from eagle3_jax.decoding import plain
from eagle3_jax.decoding import speculative as spec
from eagle3_jax.decoding.drafters import method_head_tree
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.decoding.tree import TreeConfig, default_tree
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation import metrics
from eagle3_jax.prompts import encode_chat
from eagle3_jax.sharding import mesh_of, put_batch

METHODS = ("eagle3", "pld", "vanilla")


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How to decode, all but the models and the prompts (`generate_ids` and `stream_ids`).

    method: "eagle3" (the head's draft tree), "pld" (prompt lookup) or "vanilla"; tests may pass
      a drafter function (drafters.py). tree: eagle3's tree; pld drafts a chain of its depth.
    eos_ids: None for the target's. max_context: None for the target's max_position_embeddings.
    pad_id: None for the target's pad token (0 when it has none); padding never reaches an output.
    same_engine: vanilla through the speculative engine's verification step (the root alone
      each round) instead of plain decoding's loop.
    prefill_chunk: the prompts' target forward run this many tokens at a time (a multiple of
      `plain.PROMPT_BUCKET`; `plain.chunked_forward`, the programs `serve --prefill-chunk`
      admits with); 0: in one pass.
    """

    method: str | Callable = "eagle3"
    max_new_tokens: int = 128
    tree: TreeConfig = TreeConfig()
    sampling: Sampling = Sampling()
    seed: int = 0
    eos_ids: tuple[int, ...] | None = None
    max_context: int | None = None
    pad_id: int | None = None
    same_engine: bool = False
    prefill_chunk: int = 0

    def __post_init__(self):
        if not callable(self.method) and self.method not in METHODS:
            raise Eagle3Error(f"method {self.method!r}: use one of {', '.join(METHODS)}")
        if self.max_new_tokens < 1:
            raise Eagle3Error(f"max_new_tokens {self.max_new_tokens}: give 1 or more")
        if self.prefill_chunk:
            plain.chunk_sizes(plain.PROMPT_BUCKET, self.prefill_chunk)  # a multiple of it

    @property
    def speculative(self) -> bool:
        """Whether the speculative engine runs (every method but vanilla in plain's loop)."""
        return self.method != "vanilla" or self.same_engine


@dataclasses.dataclass(frozen=True)
class Row:
    """One prompt's generation: its new tokens and text, why it stopped ("eos", "max_tokens" or
    "context"), the target passes it took (its prefill's included) and, from the speculative
    engine, its rounds by accepted draft tokens ([depth + 1]) and the tree tokens verified."""

    output_ids: list[int]
    text: str
    finish_reason: str
    target_forwards: int
    accept_hist: list[int] | None = None
    verified_tokens: int | None = None

    @property
    def tau(self) -> float:
        """τ of this generation (`metrics.tau_of`); 1.0 when it ran no round."""
        return metrics.tau_of(len(self.output_ids), self.target_forwards, no_round=1.0)


@dataclasses.dataclass(frozen=True)
class Generation:
    """What one generation call produced, row by row (B prompts).

    output_ids: B lists of new token ids; texts: their decoded text ("" without a tokenizer);
    finish_reasons: "eos", "max_tokens" or "context"; target_forwards: B target passes, the
    prefill's included; accept_hist: [B, depth + 1] rounds by accepted draft tokens and
    verified_tokens: B tree tokens verified over the rounds (None from plain decoding's loop).
    """

    method: str
    output_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    target_forwards: list[int]
    wall_time_s: float
    accept_hist: np.ndarray | None = None
    verified_tokens: list[int] | None = None

    @property
    def tau(self) -> float:
        """Tokens per verification round over all rows (`metrics.tau_of`; 1.0 for vanilla)."""
        rows = len(self.output_ids)
        tokens = sum(len(o) for o in self.output_ids)
        return metrics.tau_of(tokens, sum(self.target_forwards), rows)

    @property
    def acceptance_rates(self) -> list[float]:
        """alpha_d = P(accept >= d+1 | accept >= d) per draft depth d (empty for vanilla)."""
        return [] if self.accept_hist is None else metrics.acceptance_rates(self.accept_hist)

    def rows(self) -> list[Row]:
        """The B rows, each a `Row`."""
        b = len(self.output_ids)
        hist = [None] * b if self.accept_hist is None else np.asarray(self.accept_hist).tolist()
        verified = self.verified_tokens or [None] * b
        return [
            Row(*fields)
            for fields in zip(
                self.output_ids, self.texts, self.finish_reasons, self.target_forwards, hist,
                verified,
            )
        ]  # fmt: skip


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
    opts = DecodeOptions(method, max_new_tokens, tree or default_tree(), sampling, seed,
                         max_context=max_context)  # fmt: skip
    return generate_ids(target, head, encode(target, prompts, chat_template), opts)


class _Engine(NamedTuple):
    """The speculative engine's arguments for one request (prefill's, then the loop's)."""

    models: tuple  # (tparams, dparams, embed, vocab)
    req: plain.Request
    static: tuple  # (tcfg, dcfg, shape, tree, sampling, eos_ids): static in every program
    method: Any


def _engine(target: Target, head: Head | None, prompts, opts: DecodeOptions) -> _Engine:
    """Checks the method against the head, picks the tree it verifies and prepares the batch."""
    method = opts.method
    head, tree = method_head_tree(method, head, opts.tree, " (decode: --draft)")
    dparams, dcfg, vocab, embed = head or (None, None, None, None)
    tcfg = target.cfg
    pad = _pad(target, opts)
    req = plain.prepare(tcfg, prompts, opts.max_new_tokens, opts.eos_ids, opts.max_context, pad,
                        tree.round_slots + 1)  # fmt: skip
    embed = target.params["embed"] if embed is None else embed
    models = (target.params, dparams, embed, vocab)
    return _Engine(models, req, (tcfg, dcfg, req.shape, tree, opts.sampling, req.eos), method)


def _pad(target: Target, opts: DecodeOptions) -> int:
    return (target.cfg.pad_token_id or 0) if opts.pad_id is None else opts.pad_id


def _speculative(target: Target, head, prompts, opts: DecodeOptions, warmup: bool) -> Generation:
    """The speculative engine over a batch: prefill, then rounds on device until every row ends."""
    eng = _engine(target, head, prompts, opts)
    req, key, mesh = eng.req, jax.random.PRNGKey(opts.seed), mesh_of(target.params)
    # on a mesh, global arrays: the rows over `data`, on every process from the same request
    prompt, lengths, limit, ones = put_batch(mesh, req.tokens, req.lengths, req.limit,
                                             np.ones_like(req.limit))  # fmt: skip
    if warmup:
        st = _prefill(eng, prompt, lengths, ones, key, opts, mesh)
        jax.block_until_ready(spec.decode_loop(*eng.models, st, *eng.static, eng.method))
    t0 = time.perf_counter()
    state = _prefill(eng, prompt, lengths, limit, key, opts, mesh)
    state = spec.decode_loop(*eng.models, state, *eng.static, eng.method)
    fields = (state.tokens, state.num_new, state.finish, state.forwards, state.accept_hist,
              state.verified)  # fmt: skip
    tokens, n, finish, fw, hist, ver = distributed.to_host(fields)  # every process's rows
    wall = time.perf_counter() - t0
    return _result(
        target, opts, [list(map(int, tokens[i, : n[i]])) for i in range(len(n))],
        [plain.FINISH_REASONS[f] for f in finish], [int(x) for x in fw], wall,
        np.asarray(hist), [int(x) for x in ver],
    )  # fmt: skip


def _prefill(eng: _Engine, prompt, lengths, limit, key, opts: DecodeOptions, mesh):
    """The speculative state after the prompts' prefill: one pass, or `opts.prefill_chunk`
    tokens at a time."""
    if opts.prefill_chunk:
        return spec.prefill_chunked(*eng.models, prompt, lengths, limit, key, *eng.static,
                                    opts.prefill_chunk, mesh=mesh)  # fmt: skip
    return spec.prefill(*eng.models, prompt, lengths, limit, key, *eng.static, mesh=mesh)


def _result(target, opts, output_ids, finish, forwards, wall, hist=None, verified=None):
    tok = target.tokenizer
    texts = [tok.decode(o, skip_special_tokens=True) if tok is not None else "" for o in output_ids]
    method = opts.method if isinstance(opts.method, str) else getattr(opts.method, "__name__", "?")
    return Generation(method, output_ids, texts, finish, forwards, float(wall), hist, verified)


def generate_ids(
    target: Target,
    head: Head | None,
    prompts: list[list[int]],
    opts: DecodeOptions,
    warmup: bool = False,
) -> Generation:
    """Decodes B token-id prompts as `opts` says; each row stops at EOS, max tokens or the context.

    Args:
      target: params, cfg and tokenizer (None: texts are ""); a `Target(params, cfg, None, None)`
        will do.
      head: a `Head` (params, cfg, vocab, embed) for eagle3 (or a test's drafter); else None.
      prompts: B lists of token ids.
      warmup: first runs the same compiled programs with a one-token limit, so `wall_time_s`
        measures decoding, not compilation.
    """
    if opts.speculative:
        return _speculative(target, head, prompts, opts, warmup)
    res = plain.generate(
        target.params, target.cfg, prompts, opts.max_new_tokens, opts.sampling, opts.seed,
        opts.eos_ids, opts.max_context, _pad(target, opts), warmup,
        prefill_chunk=opts.prefill_chunk,
    )  # fmt: skip
    forwards = [len(o) for o in res.output_ids]  # one target pass per token
    return _result(target, opts, res.output_ids, res.finish_reasons, forwards, res.wall_time_s)


def stream_ids(
    target: Target, head: Head | None, prompt: list[int], opts: DecodeOptions
) -> Iterator[list[int]]:
    """Yields one prompt's new tokens as they are produced, a list per round (one token per
    plain decoding step), for interactive chat; `opts` as `generate_ids` takes them."""
    if not opts.speculative:
        for t in plain.stream(target.params, target.cfg, prompt, opts.max_new_tokens,
                              opts.sampling, opts.seed, opts.eos_ids, opts.max_context,
                              opts.prefill_chunk):  # fmt: skip
            yield [t]
        return
    eng = _engine(target, head, [prompt], opts)
    req = eng.req
    state = _prefill(
        eng,
        req.tokens,
        req.lengths,
        req.limit,
        jax.random.PRNGKey(opts.seed),
        opts,
        mesh_of(target.params),
    )
    shown = 0
    while True:
        n, finish = int(state.num_new[0]), int(state.finish[0])
        yield [int(t) for t in np.asarray(state.tokens[0, shown:n])]
        shown = n
        if finish != 0:
            return
        state = spec.round_step(*eng.models, state, *eng.static, eng.method)
