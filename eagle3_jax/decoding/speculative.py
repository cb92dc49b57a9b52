"""EAGLE-3 speculative decoding: one jitted round = draft a tree + verify it + update both caches.

Per row and round (all shapes static; per-row lengths are arrays):
  1. the draft encodes the pairs (target feature at p, token at p + 1) for the positions the target
     committed last round, onto its stable cache; the last pair ends at the root (the token produced
     last, at position r = `length`, in neither cache yet);
  2. EAGLE-2's dynamic tree: top-k children of the root, then `depth - 1` expansion levels, each
     running the draft on the k best nodes (by cumulative log-prob) with a mask of prefix + ancestors;
     the global top-N of the candidate pool forms the tree (tree.py);
  3. the target runs the N + 1 tree tokens at positions r + depth against its cache under the tree
     mask, returning logits and the aux features of every node;
  4. acceptance (greedy here; lossless sampling in acceptance.py) picks a root-to-node path, whose
     K/V are compacted to the contiguous slots r .. r + a, and a bonus token;
  5. the a + 1 new tokens are emitted; their features become the next round's encode pairs.

Nothing about a round depends on Python values, so a whole generation is one `lax.while_loop`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.config import TargetConfig
from eagle3_jax.decoding import acceptance
from eagle3_jax.decoding.plain import FINISH_REASONS, Shape, prepare
from eagle3_jax.decoding.sampling import Sampling, sample
from eagle3_jax.decoding.tree import chain_tree, select_tree
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.models import target as tgt
from eagle3_jax.models.layers import causal_mask
from eagle3_jax.vocab import DraftVocab


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2 dynamic tree: `depth` drafted tokens at most per path, `top_k` children per expanded
    node, `total_tokens` nodes verified per round including the root (SGLang's
    num-draft-tokens). A chain is top_k = 1, total_tokens = depth + 1. EAGLE's own `depth` flag
    counts expansion steps after the first: its depth d is our depth d + 1."""

    top_k: int = 4
    depth: int = 4
    total_tokens: int = 16

    @property
    def n(self) -> int:
        return self.total_tokens - 1

    @property
    def pool_size(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def tree_slots(self) -> int:
        """Draft cache slots for the nodes expanded in one round (never kept across rounds)."""
        return (self.depth - 1) * self.top_k

    def validate(self, draft_vocab_size: int) -> TreeConfig:
        if self.depth < 1:
            raise Eagle3Error(f"tree depth {self.depth} < 1: draft at least one token per round")
        if self.top_k < 1:
            raise Eagle3Error(f"top_k {self.top_k} < 1")
        if self.top_k > draft_vocab_size:
            raise Eagle3Error(
                f"top_k {self.top_k} exceeds the draft vocabulary ({draft_vocab_size})"
            )
        if not 2 <= self.total_tokens <= self.pool_size + 1:
            raise Eagle3Error(
                f"total_tokens {self.total_tokens} must be in 2..{self.pool_size + 1} for top_k "
                f"{self.top_k} and depth {self.depth} (root + at most {self.pool_size} candidates)"
            )
        return self


class SpecState(NamedTuple):
    tcache: dict[str, Any]
    dcache: dict[str, Any]
    length: jax.Array  # [B] tokens committed to the target cache; the root sits at this position
    root: jax.Array  # [B] newest token (already emitted), in neither cache
    enc_tok: jax.Array  # [B, E] tokens at positions length - enc_n + 1 .. length (root last)
    enc_feat: jax.Array  # [B, E, F] target aux features at positions length - enc_n .. length - 1
    enc_n: jax.Array  # [B] valid encode pairs (1 .. depth + 1)
    tokens: jax.Array  # [B, max_new + E] emitted tokens
    history: (
        jax.Array
    )  # [B, S] every token by position (prompt, then emitted): prompt lookup reads it
    num_new: jax.Array  # [B]
    finish: jax.Array  # [B] index into FINISH_REASONS
    forwards: jax.Array  # [B] target forward passes while the row ran (prefill included)
    accept_hist: jax.Array  # [B, depth + 1] rounds by number of accepted draft tokens
    limit: jax.Array  # [B]
    key: jax.Array


def _map_cache(fn, cache: dict[str, Any]) -> dict[str, Any]:
    """Applies a per-layer [B, S, G, K] function to a list-of-layers or [L, ...]-stacked cache."""
    if isinstance(cache["k"], list):
        return {n: [fn(c) for c in cache[n]] for n in ("k", "v")}
    return {n: jax.vmap(fn)(cache[n]) for n in ("k", "v")}


def _compact(c_BSGK: jax.Array, src_BJ: jax.Array, dst_B: jax.Array) -> jax.Array:
    """Copies slots src[b, j] to dst[b] + j (the accepted path, made contiguous)."""
    rows = jnp.take_along_axis(c_BSGK, src_BJ[:, :, None, None], axis=1)
    return tgt._write_rows(c_BSGK, rows, dst_B)


def _eos_mask(tok, eos_ids):
    if not eos_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.isin(tok, jnp.asarray(eos_ids, jnp.int32))


@functools.partial(
    jax.jit, static_argnames=("tcfg", "dcfg", "shape", "tree", "sampling", "eos_ids")
)
def prefill(
    tparams,
    dparams,
    embed,
    vocab: DraftVocab,
    prompt_BT,
    lengths_B,
    limit_B,
    key,
    tcfg: TargetConfig,
    dcfg: drf.DraftConfig,
    shape: Shape,
    tree: TreeConfig,
    sampling: Sampling,
    eos_ids: tuple[int, ...],
) -> SpecState:
    """Target prefill (root token + aux features) and the draft's encode of the prompt."""
    b, t = prompt_BT.shape
    dtype = jax.tree.leaves(tparams)[0].dtype
    zeros = jnp.zeros((b,), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    tcache = tgt.make_cache(
        tcfg, b, shape.slots, dtype, stacked=not isinstance(tparams["layers"], list)
    )
    aux_ids = () if dcfg is None else dcfg.aux_layer_ids
    out = tgt.forward(
        tparams,
        prompt_BT,
        positions,
        causal_mask(zeros, t, shape.slots, tcfg.sliding_window),
        tcfg,
        tcache,
        zeros,
        aux_ids=aux_ids,
        logits_idx_BP=(lengths_B - 1)[:, None],
    )
    key, sub = jax.random.split(key)
    root = sample(out.logits[:, 0], sub, sampling)
    e = tree.depth + 1
    rows = jnp.arange(b)
    dcache: dict[str, Any] = {}
    feat = jnp.zeros((b, t, 0), dtype)
    if dcfg is not None:
        # draft: pairs (feature p, token p + 1) for p < length - 1; the last pair (p = length - 1,
        # root) is left to the first round, which needs its output to start the tree.
        next_tok = jnp.concatenate([prompt_BT[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
        dslots = shape.slots + tree.tree_slots
        dcache = drf.make_cache(dcfg, b, dslots, dtype)
        dcache = drf.forward(
            dparams,
            embed,
            next_tok,
            out.aux,
            positions,
            causal_mask(zeros, t, dslots),
            dcfg,
            dcache,
            zeros,
            compute_logits=False,
            target_features=True,
        ).cache
        feat = out.aux
    enc_tok = jnp.zeros((b, e), jnp.int32).at[:, 0].set(root)
    enc_feat = jnp.zeros((b, e, feat.shape[-1]), feat.dtype).at[:, 0].set(feat[rows, lengths_B - 1])
    history = (
        jnp.zeros((b, shape.slots), jnp.int32)
        .at[:, :t]
        .set(prompt_BT)
        .at[rows, lengths_B]
        .set(root)
    )
    tokens = jnp.zeros((b, shape.max_new + e), jnp.int32).at[:, 0].set(root)
    num_new = jnp.ones((b,), jnp.int32)
    finish = jnp.where(_eos_mask(root, eos_ids), 1, jnp.where(num_new >= limit_B, 2, 0)).astype(
        jnp.int32
    )
    return SpecState(
        out.cache,
        dcache,
        lengths_B,
        root,
        enc_tok,
        enc_feat,
        jnp.ones((b,), jnp.int32),
        tokens,
        history,
        num_new,
        finish,
        jnp.ones((b,), jnp.int32),
        jnp.zeros((b, tree.depth + 1), jnp.int32),
        limit_B,
        key,
    )


def eagle3_drafter(
    dparams,
    embed,
    vocab: DraftVocab,
    state: SpecState,
    dcfg: drf.DraftConfig,
    shape: Shape,
    tree: TreeConfig,
):
    """Steps 1-2: encode the new pairs, grow the dynamic tree. Returns (Tree [batched], draft cache)."""
    b = state.root.shape[0]
    k, depth, e = tree.top_k, tree.depth, tree.depth + 1
    s, dslots = shape.slots, shape.slots + tree.tree_slots
    r = state.length
    start = r - state.enc_n
    slot_ids = jnp.arange(dslots)
    pos = start[:, None] + jnp.arange(e, dtype=jnp.int32)[None, :]
    mask = (
        slot_ids[None, None, :] <= pos[:, :, None]
    )  # stable slots only: tree slots are >= s > pos
    out = drf.forward(
        dparams,
        embed,
        state.enc_tok,
        state.enc_feat,
        pos,
        mask,
        dcfg,
        state.dcache,
        start,
        compute_logits=False,
        target_features=True,
    )
    rows = jnp.arange(b)
    last = state.enc_n - 1
    h0 = out.hidden[rows, last]
    score, tok = drf.draft_topk(dparams, h0, dcfg, vocab, k)  # [B, k] log-probs, target ids
    pool_tok, pool_par, pool_score = [tok], [jnp.full((b, k), -1, jnp.int32)], [score]
    exp_idx = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
    exp_tok, exp_score = tok, score
    exp_h = jnp.broadcast_to(h0[:, None, :], (b, k, h0.shape[-1]))
    exp_anc = jnp.zeros((b, k, tree.tree_slots), bool)
    dcache = out.cache
    stable = jnp.arange(s)[None, None, :] < r[:, None, None]  # [B, 1, S]
    for lvl in range(2, depth + 1):
        own = jax.nn.one_hot((lvl - 2) * k + jnp.arange(k), tree.tree_slots, dtype=bool)  # [k, TS]
        anc = exp_anc | own[None]
        mask = jnp.concatenate([jnp.broadcast_to(stable, (b, k, s)), anc], axis=-1)
        pos = jnp.broadcast_to((r + lvl - 2)[:, None], (b, k))
        o = drf.forward(
            dparams,
            embed,
            exp_tok,
            exp_h,
            pos,
            mask,
            dcfg,
            dcache,
            jnp.full((b,), s + (lvl - 2) * k, jnp.int32),
            compute_logits=False,
            target_features=False,
        )
        dcache = o.cache
        cs, ct = drf.draft_topk(dparams, o.hidden, dcfg, vocab, k)  # [B, k, k]
        cum = (exp_score[:, :, None] + cs).reshape(b, k * k)
        child_tok = ct.reshape(b, k * k)
        pool_tok.append(child_tok)
        pool_par.append(jnp.repeat(exp_idx, k, axis=1))
        pool_score.append(cum)
        if lvl < depth:
            base = k + (lvl - 2) * k * k
            nxt_score, j = jax.lax.top_k(cum, k)
            par = j // k
            exp_idx = base + j
            exp_tok = jnp.take_along_axis(child_tok, j, axis=1)
            exp_score = nxt_score
            exp_h = jnp.take_along_axis(o.hidden, par[:, :, None], axis=1)
            exp_anc = jnp.take_along_axis(anc, par[:, :, None], axis=1)
    pool = [jnp.concatenate(x, axis=1) for x in (pool_tok, pool_par, pool_score)]
    trees = jax.vmap(select_tree, in_axes=(0, 0, 0, 0, None))(state.root, *pool, tree.n)
    return trees, dcache


def pld_drafter(
    dparams,
    embed,
    vocab,
    state: SpecState,
    dcfg,
    shape: Shape,
    tree: TreeConfig,
    max_ngram: int = 3,
):
    """Prompt lookup decoding: find the latest earlier occurrence of the context's last n tokens
    (n = max_ngram, then shorter) and propose the `depth` tokens that followed it, as a chain."""
    r = state.length
    hist = state.history
    s = hist.shape[1]
    pos = jnp.arange(s)[None, :]
    found = jnp.zeros(r.shape, bool)
    start = jnp.zeros(r.shape, jnp.int32)
    for n in range(max_ngram, 0, -1):
        # match[b, i]: hist[i - n + 1 .. i] == hist[r - n + 1 .. r] with i < r (an EARLIER window)
        match = (pos < r[:, None]) & (pos >= n - 1)
        for m in range(n):
            want = jnp.take_along_axis(hist, jnp.maximum(r - m, 0)[:, None], axis=1)
            match = match & (jnp.roll(hist, m, axis=1) == want) & (r[:, None] >= n - 1)
        last = jnp.max(jnp.where(match, pos, -1), axis=1)
        use = ~found & (last >= 0)
        start = jnp.where(use, last + 1, start)
        found = found | use
    idx = jnp.minimum(start[:, None] + jnp.arange(tree.depth)[None, :], r[:, None])
    chain = jnp.take_along_axis(hist, idx, axis=1)
    return jax.vmap(chain_tree)(
        state.root, chain, jnp.zeros(chain.shape, jnp.float32)
    ), state.dcache


def vanilla_drafter(dparams, embed, vocab, state: SpecState, dcfg, shape: Shape, tree: TreeConfig):
    """No draft: the root alone is verified (plain decoding through the same verification step)."""
    b = state.root.shape[0]
    root_only = jax.vmap(chain_tree)(state.root, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0)))
    return root_only, state.dcache


DRAFTERS = {"eagle3": eagle3_drafter, "pld": pld_drafter, "vanilla": vanilla_drafter}


def verify(
    tparams, trees, state: SpecState, tcfg: TargetConfig, dcfg: drf.DraftConfig, shape: Shape
):
    """Step 3: the target over the N + 1 tree tokens, written at slots r .. r + N."""
    r = state.length
    n1 = trees.tokens.shape[1]
    rel = jnp.arange(shape.slots)[None, :] - r[:, None]  # [B, S]
    in_tree = (rel >= 0) & (rel < n1)
    tree_part = jnp.take_along_axis(trees.mask, jnp.clip(rel, 0, n1 - 1)[:, None, :], axis=2)
    mask = (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree_part)  # [B, N+1, S]
    positions = r[:, None] + trees.depth
    return tgt.forward(
        tparams,
        trees.tokens,
        positions,
        mask,
        tcfg,
        state.tcache,
        r,
        aux_ids=() if dcfg is None else dcfg.aux_layer_ids,
    )


def _round(
    tparams,
    dparams,
    embed,
    vocab,
    state: SpecState,
    tcfg,
    dcfg,
    shape: Shape,
    tree: TreeConfig,
    sampling: Sampling,
    eos_ids,
    method="eagle3",
) -> SpecState:
    b = state.root.shape[0]
    e = tree.depth + 1
    rows = jnp.arange(b)
    running = state.finish == 0
    drafter = DRAFTERS[method] if isinstance(method, str) else method  # tests may pass a callable
    trees, dcache = drafter(dparams, embed, vocab, state, dcfg, shape, tree)
    tout = verify(tparams, trees, state, tcfg, dcfg, shape)
    key, sub = jax.random.split(state.key)
    acc, bonus = acceptance.accept(trees, tout.logits, sub, sampling, tree.depth, tree.top_k)
    a = acc.length
    r = state.length
    tcache = _map_cache(lambda c: _compact(c, r[:, None] + acc.path, r), tout.cache)
    # emitted this round: the accepted drafted tokens, then the bonus
    j = jnp.arange(e)[None, :]
    path_next = jnp.take_along_axis(acc.path, jnp.minimum(j + 1, tree.depth), axis=1)
    emit = jnp.where(
        j < a[:, None], jnp.take_along_axis(trees.tokens, path_next, axis=1), bonus[:, None]
    )
    is_eos = _eos_mask(emit, eos_ids) & (j <= a[:, None])
    has_eos = jnp.any(is_eos, axis=1)
    count = jnp.where(has_eos, jnp.argmax(is_eos, axis=1) + 1, a + 1)
    room = state.limit - state.num_new
    stop_eos = has_eos & (count <= room)
    count = jnp.minimum(count, room)
    length = r + a + 1
    no_room = length + tree.total_tokens + 1 > shape.slots  # the next round would not fit
    finish = jnp.where(stop_eos, 1, jnp.where(count >= room, 2, jnp.where(no_room, 3, 0)))
    # writes past `count` are overwritten next round or lie beyond the row's final length
    tokens = state.tokens.at[rows[:, None], state.num_new[:, None] + j].set(emit)
    history = state.history.at[rows[:, None], jnp.minimum(r[:, None] + 1 + j, shape.slots - 1)].set(
        emit
    )
    enc_feat = (
        state.enc_feat
        if tout.aux is None
        else jnp.take_along_axis(tout.aux, acc.path[:, :, None], axis=1)
    )
    upd = lambda new, old: jnp.where(running.reshape((b,) + (1,) * (new.ndim - 1)), new, old)  # noqa
    hist = state.accept_hist.at[rows, a].add(running.astype(jnp.int32))
    return SpecState(
        tcache,
        dcache,
        upd(length, state.length),
        upd(bonus, state.root),
        upd(emit, state.enc_tok),
        upd(enc_feat, state.enc_feat),
        upd(a + 1, state.enc_n),
        upd(tokens, state.tokens),
        upd(history, state.history),
        upd(state.num_new + count, state.num_new),
        upd(finish.astype(jnp.int32), state.finish),
        state.forwards + running,
        hist,
        state.limit,
        key,
    )


_STATIC = ("tcfg", "dcfg", "shape", "tree", "sampling", "eos_ids", "method")
round_step = jax.jit(_round, static_argnames=_STATIC, donate_argnums=4)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnums=4)
def decode_loop(
    tparams,
    dparams,
    embed,
    vocab,
    state: SpecState,
    tcfg,
    dcfg,
    shape: Shape,
    tree: TreeConfig,
    sampling: Sampling,
    eos_ids,
    method="eagle3",
) -> SpecState:
    """Rounds until every row has finished, on device."""
    return jax.lax.while_loop(
        lambda st: jnp.any(st.finish == 0),
        lambda st: _round(
            tparams, dparams, embed, vocab, st, tcfg, dcfg, shape, tree, sampling, eos_ids, method
        ),
        state,
    )


class SpecResult(NamedTuple):
    output_ids: list[list[int]]
    finish_reasons: list[str]
    target_forwards: list[int]  # per row, prefill included
    accept_hist: np.ndarray  # [B, depth + 1] rounds by accepted draft tokens
    wall_time_s: float


def method_tree(method: str, tree: TreeConfig, draft_vocab_size: int | None) -> TreeConfig:
    """The tree each method verifies: eagle3 its own; pld a chain of `depth`; vanilla the root alone."""
    if method == "vanilla":
        return TreeConfig(top_k=1, depth=1, total_tokens=1)
    if method == "pld":
        return TreeConfig(top_k=1, depth=tree.depth, total_tokens=tree.depth + 1).validate(1)
    if method != "eagle3" and not callable(method):
        raise Eagle3Error(f"unknown method {method!r}: use eagle3, pld or vanilla")
    return tree.validate(draft_vocab_size or tree.top_k)


def _method_setup(method, dparams, dcfg, vocab, tree: TreeConfig):
    """The draft each method uses (none for pld / vanilla) and the tree it verifies."""
    if method == "eagle3" and (dparams is None or dcfg is None or vocab is None):
        raise Eagle3Error("method eagle3 needs a draft head: pass --draft PATH")
    if method != "eagle3" and not callable(method):
        dparams = dcfg = vocab = None
    choices = None
    if dcfg is not None:  # SpecVocab drafts among its per-row candidates only
        choices = dcfg.spec_candidates if dcfg.speculator_rank else dcfg.draft_vocab_size
    tree = method_tree(method, tree, choices)
    return dparams, dcfg, vocab, tree


def generate(
    tparams,
    tcfg: TargetConfig,
    dparams,
    dcfg: drf.DraftConfig | None,
    vocab: DraftVocab | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    tree: TreeConfig = TreeConfig(),
    sampling: Sampling = Sampling(),
    seed: int = 0,
    eos_ids: tuple[int, ...] | None = None,
    max_context: int | None = None,
    pad_id: int = 0,
    embed=None,
    warmup: bool = False,
    method: str = "eagle3",
) -> SpecResult:
    """Speculative decoding of token-id prompts: greedy output equals plain decoding token for token,
    sampled output has the target's distribution. `method` "pld" and "vanilla" need no draft."""
    dparams, dcfg, vocab, tree = _method_setup(method, dparams, dcfg, vocab, tree)
    req = prepare(
        tcfg, prompts, max_new_tokens, eos_ids, max_context, pad_id, tree.total_tokens + 1
    )
    embed = tparams["embed"] if embed is None else embed
    key = jax.random.PRNGKey(seed)
    args = (tcfg, dcfg, req.shape, tree, sampling, req.eos)
    inputs = (tparams, dparams, embed, vocab, req.tokens, req.lengths)
    if warmup:
        st = prefill(*inputs, np.ones_like(req.limit), key, *args)
        jax.block_until_ready(decode_loop(tparams, dparams, embed, vocab, st, *args, method))
    t0 = time.perf_counter()
    state = prefill(*inputs, req.limit, key, *args)
    state = decode_loop(tparams, dparams, embed, vocab, state, *args, method)
    tokens, n, finish, fw, hist = jax.device_get(
        (state.tokens, state.num_new, state.finish, state.forwards, state.accept_hist)
    )
    wall = time.perf_counter() - t0
    return SpecResult(
        [list(map(int, tokens[i, : n[i]])) for i in range(len(n))],
        [FINISH_REASONS[f] for f in finish],
        [int(x) for x in fw],
        np.asarray(hist),
        wall,
    )


def stream(
    tparams,
    tcfg: TargetConfig,
    dparams,
    dcfg,
    vocab,
    prompt: list[int],
    max_new_tokens: int,
    tree: TreeConfig = TreeConfig(),
    sampling: Sampling = Sampling(),
    seed: int = 0,
    eos_ids: tuple[int, ...] | None = None,
    max_context: int | None = None,
    embed=None,
    method: str = "eagle3",
):
    """Yields each round's newly accepted tokens (a list) for one prompt, for interactive chat."""
    dparams, dcfg, vocab, tree = _method_setup(method, dparams, dcfg, vocab, tree)
    req = prepare(tcfg, [prompt], max_new_tokens, eos_ids, max_context, 0, tree.total_tokens + 1)
    embed = tparams["embed"] if embed is None else embed
    args = (tcfg, dcfg, req.shape, tree, sampling, req.eos)
    state = prefill(
        tparams,
        dparams,
        embed,
        vocab,
        req.tokens,
        req.lengths,
        req.limit,
        jax.random.PRNGKey(seed),
        *args,
    )
    shown = 0
    while True:
        n, finish = int(state.num_new[0]), int(state.finish[0])
        yield [int(t) for t in np.asarray(state.tokens[0, shown:n])]
        shown = n
        if finish != 0:
            return
        state = round_step(tparams, dparams, embed, vocab, state, *args, method)


def acceptance_rates(hist: np.ndarray) -> list[float]:
    """Per-depth acceptance alpha_d = P(accept >= d+1 | accept >= d) from a rounds-by-length histogram
    ([depth + 1] or [B, depth + 1], summed over rows). NaN where no round reached depth d."""
    h = np.asarray(hist).reshape(-1, np.shape(hist)[-1]).sum(0)
    at_least = np.cumsum(h[::-1])[::-1]  # rounds accepting >= d
    return [
        float(at_least[d + 1] / at_least[d]) if at_least[d] else float("nan")
        for d in range(len(h) - 1)
    ]


def tau(new_tokens: int, target_forwards: int) -> float:
    """Mean tokens per verification round (bonus included; the prefill's token and pass excluded)."""
    rounds = target_forwards - 1
    return (new_tokens - 1) / rounds if rounds > 0 else float(new_tokens)
