"""Greedy speculative decoding replayed over a known greedy answer: decoding's τ and acceptance
without verifying a tree with the target.

Under greedy decoding the tokens a speculative round accepts are, by construction, the target's
plain greedy answer y: a node is accepted exactly when its path from the root spells y's next
tokens, and the bonus is y's token after the deepest such node. The target's pass over the tree
therefore only tells acceptance two things for a node whose path matches y: y's next token (the
target's greedy choice there) and the target's aux features at the node's position, which the
draft reads next round. Both are known from ONE teacher-forced target forward over the prompt and
y. Replay runs decoding's own round (`speculative.decode_loop`: the same drafter from the same
draft state, the same acceptance and bookkeeping) with that forward's results in place of the
target's tree pass (`oracle_pass`, given to the round as its `target_pass`); every other node gets
a next token that matches nothing (-1) and features no accepted path reads. The target's KV cache
is used only by the teacher-forced forward; the rounds run the draft alone.

Past y's end (an EOS, or max_new_tokens) the last round may still accept drafted tokens that are
never emitted; their acceptance counts in the histogram, so the target's greedy continuation
after y is extended by `depth` tokens (plain greedy steps on the same cache).

What replay assumes, and checks: y is the target's greedy answer to the prompt under the same
sampling settings (greedy; temperature 0), and it is whole: it ends at its first EOS or holds
max_new_tokens tokens. The prefill's first token must be y's first, and at every later token the
teacher-forced logit of y's token must be within `slack` of the largest (float rounding between
the plain decode that made y and this forward); otherwise `start` raises Eagle3Error. Equality
with real decoding then holds up to the float rounding between a teacher-forced forward and a
tree verification (design.md, "Precision"): the two give the draft features that differ in the
last bits, which can flip a near-tie in the draft's ranking.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.checkpoints import Target
from eagle3_jax.checkpoints.heads import Head
from eagle3_jax.config import TargetConfig
from eagle3_jax.decoding import plain
from eagle3_jax.decoding import speculative as spec
from eagle3_jax.decoding.drafters import method_head_tree
from eagle3_jax.decoding.generate import DecodeOptions, Generation
from eagle3_jax.decoding.plain import Shape
from eagle3_jax.decoding.state import SpecState
from eagle3_jax.decoding.tree import Tree
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.models import target as tgt
from eagle3_jax.models.layers import causal_mask
from eagle3_jax.sharding import mesh_of

# how far below the largest teacher-forced logit y's token may score and still count as the
# target's greedy choice: float32's rounding between two orders of the same sums is far below
# the first, bfloat16's far below the second (design.md, "Precision")
SLACK = {"float32": 1e-3, "float64": 1e-6}
SLACK_LOW_PRECISION = 1.0


class Oracle(NamedTuple):
    """What replay knows of the target, per row: the sequence by position and its features.

    tokens_BS: [B, S] the prompt, y, then the target's greedy tokens after y; -1 beyond (and on
      prompt padding). feat_BXF: [B, X, F] the target's aux features at positions start_B ..
      start_B + X - 1 (teacher-forced over y; zeros after it). start_B: [B] prompt lengths.
    """

    tokens_BS: jax.Array
    feat_BXF: jax.Array
    start_B: jax.Array


def oracle_pass(
    oracle: Oracle, trees: Tree, state: SpecState, tcfg, dcfg, shape: Shape
) -> tgt.Output:
    """`verify.forward_tree` answered from the oracle: the target's greedy token after each node
    ([B, N+1] int, which acceptance takes in place of logits) is the known sequence's next token
    where the node's path spells the sequence, -1 elsewhere; aux [B, N+1, F] the features at the
    nodes' positions (read only on the accepted path, which spells the sequence); no cache."""
    s = oracle.tokens_BS.shape[1]
    pos = state.length[:, None] + trees.depth  # [B, N+1]
    here = jnp.take_along_axis(oracle.tokens_BS, jnp.minimum(pos, s - 1), axis=1)
    after = jnp.take_along_axis(oracle.tokens_BS, jnp.minimum(pos + 1, s - 1), axis=1)
    ok = (trees.tokens == here) & (pos < s)
    # a node matches when it and every ancestor do (mask[i, j]: j is i or an ancestor of i)
    matched = jnp.all(ok[:, None, :] | ~trees.mask, axis=-1)
    greedy = jnp.where(matched, after, -1).astype(jnp.int32)
    aux = None
    if dcfg is not None:
        x = oracle.feat_BXF.shape[1]
        rel = jnp.clip(pos - oracle.start_B[:, None], 0, x - 1)
        aux = jnp.take_along_axis(oracle.feat_BXF, rel[:, :, None], axis=1)
    return tgt.Output(greedy, None, aux, {})


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "shape", "depth"))
def teacher(
    tparams,
    state: SpecState,
    answer_BY: jax.Array,
    n_B: jax.Array,
    tcfg: TargetConfig,
    dcfg: drf.DraftConfig | None,
    shape: Shape,
    depth: int,
) -> tuple[Oracle, jax.Array]:
    """The teacher-forced forward over the answers (right-padded answer_BY [B, Y], n_B tokens
    each) on the prefill's cache (the prompt), then `depth` greedy tokens after each answer.
    Returns (the Oracle; gap [B, Y]: how far y[j + 1]'s logit lies below the largest after y[j],
    0 past the answer)."""
    b, y = answer_BY.shape
    t = state.length
    rows = jnp.arange(b)
    pos = t[:, None] + jnp.arange(y, dtype=jnp.int32)[None, :]
    out = tgt.forward(
        tparams,
        answer_BY,
        pos,
        causal_mask(t, y, shape.slots),
        tcfg,
        state.tcache,
        t,
        aux_ids=() if dcfg is None else dcfg.aux_layer_ids,
    )
    logits = out.logits  # [B, Y, V]
    nxt = jnp.concatenate([answer_BY[:, 1:], answer_BY[:, :1]], axis=1)
    gap = jnp.max(logits, axis=-1) - jnp.take_along_axis(logits, nxt[:, :, None], axis=2)[..., 0]
    gap = jnp.where(jnp.arange(y)[None, :] < n_B[:, None] - 1, gap, 0.0)
    first = jnp.argmax(logits[rows, n_B - 1], axis=-1).astype(jnp.int32)

    def step(i, carry):
        cache, last, ext = carry
        cur = t + n_B + i  # where `last` goes
        o = tgt.forward(
            tparams,
            last[:, None],
            cur[:, None],
            causal_mask(cur, 1, shape.slots),
            tcfg,
            cache,
            cur,
        )
        tok = jnp.argmax(o.logits[:, 0], axis=-1).astype(jnp.int32)
        return o.cache, tok, ext.at[:, i + 1].set(tok)

    ext = jnp.zeros((b, depth), jnp.int32).at[:, 0].set(first)
    _, _, ext = jax.lax.fori_loop(0, depth - 1, step, (out.cache, first, ext))
    s = shape.slots
    slot = jnp.arange(s)[None, :]
    tokens = jnp.where(slot < t[:, None], state.history, -1)
    ans_at = jnp.where(jnp.arange(y)[None, :] < n_B[:, None], pos, s)  # s: dropped
    tokens = tokens.at[rows[:, None], ans_at].set(answer_BY, mode="drop")
    ext_at = (t + n_B)[:, None] + jnp.arange(depth)[None, :]
    tokens = tokens.at[rows[:, None], ext_at].set(ext, mode="drop")
    feat = jnp.zeros((b, y + depth + 1, 0), logits.dtype)
    if out.aux is not None:
        feat = jnp.pad(out.aux, ((0, 0), (0, depth + 1), (0, 0)))
    return Oracle(tokens, feat, t), gap


class Replay(NamedTuple):
    """A batch ready to replay: the round's arguments with the oracle as the target."""

    models: tuple  # (oracle, dparams, embed, vocab)
    state: SpecState  # the prefill's state, without the target cache
    static: tuple  # (tcfg, dcfg, shape, tree, sampling, eos_ids)
    method: Any


def _check_answers(prompts, answers, max_new: int, eos: tuple[int, ...]) -> None:
    if len(answers) != len(prompts):
        raise Eagle3Error(f"replay: {len(prompts)} prompts but {len(answers)} answers")
    for i, a in enumerate(answers):
        stops = [j for j, x in enumerate(a) if x in eos]
        if not a or len(a) > max_new:
            raise Eagle3Error(
                f"replay: answer {i} has {len(a)} tokens; give the greedy answer, 1 to "
                f"max_new_tokens ({max_new}) tokens"
            )
        if stops and stops[0] != len(a) - 1:
            raise Eagle3Error(
                f"replay: answer {i} goes on after an EOS (token {stops[0]}): not a greedy answer"
            )
        if not stops and len(a) < max_new:
            raise Eagle3Error(
                f"replay: answer {i} ends after {len(a)} tokens with no EOS and below "
                f"max_new_tokens ({max_new}): replay needs the whole greedy answer"
            )


def start(
    target: Target,
    head: Head | None,
    prompts: list[list[int]],
    answers: list[list[int]],
    opts: DecodeOptions,
    slack: float | None = None,
) -> Replay:
    """The prefill (as decoding's), the teacher-forced forward and the checks (module docstring)
    for B token-id prompts and their greedy answers; `slack` None for the parameters' dtype's."""
    method = opts.method
    if method == "vanilla":
        raise Eagle3Error("replay: vanilla drafts nothing; replay eagle3 or pld")
    if not opts.sampling.greedy:
        raise Eagle3Error(
            "replay: only greedy decoding (temperature 0) accepts exactly the greedy answer"
        )
    head, tree = method_head_tree(method, head, opts.tree, " (replay)")
    dparams, dcfg, vocab, embed = head or (None, None, None, None)
    tcfg = target.cfg
    pad = (tcfg.pad_token_id or 0) if opts.pad_id is None else opts.pad_id
    req = plain.prepare(tcfg, prompts, opts.max_new_tokens, opts.eos_ids, opts.max_context, pad,
                        tree.round_slots + 1)  # fmt: skip
    _check_answers(prompts, answers, opts.max_new_tokens, req.eos)
    embed = target.params["embed"] if embed is None else embed
    static = (tcfg, dcfg, req.shape, tree, opts.sampling, req.eos)
    models = (target.params, dparams, embed, vocab)
    state = spec.prefill(*models, req.tokens, req.lengths, req.limit,
                         jax.random.PRNGKey(opts.seed), *static,
                         mesh=mesh_of(target.params))  # fmt: skip
    ans = np.zeros((len(prompts), opts.max_new_tokens), np.int32)
    for i, a in enumerate(answers):
        ans[i, : len(a)] = a
    n = np.array([len(a) for a in answers], np.int32)
    oracle, gap = teacher(target.params, state, ans, n, tcfg, dcfg, req.shape, tree.depth)
    root, gap = jax.device_get((state.root, gap))
    if slack is None:
        name = jnp.dtype(jax.tree.leaves(target.params)[0].dtype).name
        slack = SLACK.get(name, SLACK_LOW_PRECISION)
    for i, a in enumerate(answers):
        if int(root[i]) != a[0]:
            raise Eagle3Error(
                f"replay: answer {i} starts with token {a[0]}, the target's greedy choice is "
                f"{int(root[i])}: not the target's greedy answer to this prompt"
            )
        bad = np.flatnonzero(gap[i] > slack)
        if bad.size:
            j = int(bad[0])
            raise Eagle3Error(
                f"replay: answer {i}'s token {j + 1} ({a[j + 1]}) scores {gap[i, j]:.3g} below "
                f"the target's greedy choice: not the target's greedy answer to this prompt"
            )
    # the rounds read no target cache: drop it (and the pending path K/V with it)
    state = dataclasses.replace(state, tcache={}, pending_kv={})
    return Replay((oracle, dparams, embed, vocab), state, static, method)


def replay_ids(
    target: Target,
    head: Head | None,
    prompts: list[list[int]],
    answers: list[list[int]],
    opts: DecodeOptions,
    slack: float | None = None,
) -> Generation:
    """Greedy speculative decoding of B token-id prompts as `opts` says, replayed over their
    greedy answers (lists of token ids, each the target's answer to its prompt, whole: to its
    EOS or max_new_tokens): the `Generation` decoding would give, its outputs the answers
    (cut where decoding stops for the context). `wall_time_s` is the replay's own time
    (teacher-forced forward and draft rounds), not decoding's."""
    t0 = time.perf_counter()
    rp = start(target, head, prompts, answers, opts, slack)
    state = spec.decode_loop(*rp.models, rp.state, *rp.static, rp.method, target_pass=oracle_pass)
    fields = (state.tokens, state.num_new, state.finish, state.forwards, state.accept_hist,
              state.verified)  # fmt: skip
    tokens, n, finish, fw, hist, ver = jax.device_get(fields)
    wall = time.perf_counter() - t0
    outs = [list(map(int, tokens[i, : n[i]])) for i in range(len(n))]
    reasons = [plain.FINISH_REASONS[f] for f in finish]
    for i, (o, a, why) in enumerate(zip(outs, answers, reasons)):
        if o != a[: len(o)] or (len(o) < len(a) and why != "context"):
            raise Eagle3Error(f"replay: row {i} emitted other tokens than its answer")
    tok = target.tokenizer
    texts = [tok.decode(o, skip_special_tokens=True) if tok is not None else "" for o in outs]
    label = rp.method if isinstance(rp.method, str) else getattr(rp.method, "__name__", "?")
    return Generation(label, outs, texts, reasons, [int(x) for x in fw], float(wall),
                      np.asarray(hist), [int(x) for x in ver])  # fmt: skip
