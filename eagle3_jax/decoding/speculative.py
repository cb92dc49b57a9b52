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

import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.config import TargetConfig, TreeConfig
from eagle3_jax.decoding import acceptance
from eagle3_jax.decoding.plain import FINISH_REASONS, Shape, prepare
from eagle3_jax.decoding.sampling import Sampling, sample
from eagle3_jax.decoding.tree import chain_tree, prune_tree, select_tree
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.models import target as tgt
from eagle3_jax.models.layers import causal_mask, write_kv
from eagle3_jax.sharding import mesh_of
from eagle3_jax.vocab import DraftVocab

NEG_SCORE = -1e30  # the score of a node a skipped draft level did not draft: never verified


class SpecState(NamedTuple):
    tcache: dict[str, Any]
    # last round's accepted path K/V ([B, depth + 1, G, K] per layer) and the slot it goes to:
    # written at the start of the next round, so the cache is written before it is read (written
    # after the verification's read, XLA copied the whole cache twice per round: ~20 ms on CPU)
    pending_kv: dict[str, Any]
    pending_at: jax.Array  # [B]
    dcache: dict[str, Any]
    # [B] tokens committed (the last path's K/V possibly still pending); the root sits at `length`
    length: jax.Array
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
    verified: jax.Array  # [B] tree tokens (root included) the target ran in rounds, row running
    accept_hist: jax.Array  # [B, depth + 1] rounds by number of accepted draft tokens
    limit: jax.Array  # [B]
    key: jax.Array


def _map_cache(fn, *caches: dict[str, Any]) -> dict[str, Any]:
    """Applies a per-layer function of [B, ...] arrays to list-of-layers or [L, ...]-stacked caches."""
    if isinstance(caches[0]["k"], list):
        return {n: [fn(*c) for c in zip(*(x[n] for x in caches))] for n in ("k", "v")}
    return {n: jax.vmap(fn)(*(x[n] for x in caches)) for n in ("k", "v")}


def _write_pending(tcache: dict[str, Any], pending: dict[str, Any], at_B: jax.Array):
    """Writes last round's accepted K/V ([B, depth + 1, G, K] per layer) at slots at_B onwards."""

    def write(k, v, pk, pv):
        return write_kv((k, v), pk, pv, at_B)

    if isinstance(tcache["k"], list):
        kv = [write(*c) for c in zip(tcache["k"], tcache["v"], pending["k"], pending["v"])]
        return {"k": [k for k, _ in kv], "v": [v for _, v in kv]}
    k, v = jax.vmap(write)(tcache["k"], tcache["v"], pending["k"], pending["v"])
    return {"k": k, "v": v}


def _eos_mask(tok, eos_ids):
    if not eos_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.isin(tok, jnp.asarray(eos_ids, jnp.int32))


@functools.partial(
    jax.jit, static_argnames=("tcfg", "dcfg", "shape", "tree", "sampling", "eos_ids", "mesh")
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
    mesh=None,
) -> SpecState:
    """Target prefill (root token + aux features) and the draft's encode of the prompt. With a
    mesh (the target parameters', `sharding.mesh_of`) the target cache is laid out on it
    (`target.make_cache`); the decode loop keeps it there. The draft's small cache follows the
    draft parameters' layout."""
    b, t = prompt_BT.shape
    dtype = jax.tree.leaves(tparams)[0].dtype
    zeros = jnp.zeros((b,), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    stacked = not isinstance(tparams["layers"], list)
    tcache = tgt.make_cache(tcfg, b, shape.slots, dtype, stacked=stacked, mesh=mesh)
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
    pending = _map_cache(
        lambda c: jnp.zeros((b, e, tcfg.num_kv_heads, tcfg.head_dim), c.dtype), out.cache
    )
    return SpecState(
        out.cache,
        pending,
        lengths_B,
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
        jnp.zeros((b,), jnp.int32),
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
    # adaptive verification: a level whose expanded nodes all score below the threshold can only
    # add nodes below it (a child never outscores its parent), so the draft skips it at run time
    log_thr = float(np.log(tree.verify_threshold)) if tree.verify_threshold > 0 else None
    for lvl in range(2, depth + 1):
        own = jax.nn.one_hot((lvl - 2) * k + jnp.arange(k), tree.tree_slots, dtype=bool)  # [k, TS]
        anc = exp_anc | own[None]
        mask = jnp.concatenate([jnp.broadcast_to(stable, (b, k, s)), anc], axis=-1)
        pos = jnp.broadcast_to((r + lvl - 2)[:, None], (b, k))

        def expand(dc, exp_tok=exp_tok, exp_h=exp_h, mask=mask, pos=pos, lvl=lvl):
            o = drf.forward(
                dparams,
                embed,
                exp_tok,
                exp_h,
                pos,
                mask,
                dcfg,
                dc,
                jnp.full((b,), s + (lvl - 2) * k, jnp.int32),
                compute_logits=False,
                target_features=False,
            )
            return (o.cache, o.hidden, *drf.draft_topk(dparams, o.hidden, dcfg, vocab, k))

        if log_thr is None:
            dcache, hidden, cs, ct = expand(dcache)
        else:
            shapes = jax.eval_shape(expand, dcache)

            def skip(dc, shapes=shapes):
                _, h, sc, tk = shapes
                h, tk = jnp.zeros(h.shape, h.dtype), jnp.zeros(tk.shape, tk.dtype)
                return dc, h, jnp.full(sc.shape, NEG_SCORE, sc.dtype), tk

            run = jnp.any((exp_score >= log_thr) & (state.finish == 0)[:, None])
            dcache, hidden, cs, ct = jax.lax.cond(run, expand, skip, dcache)
        # hidden [B, k, H]; cs, ct [B, k, k]: children's log-probs and target ids
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
            exp_h = jnp.take_along_axis(hidden, par[:, :, None], axis=1)
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
    """Step 3: the target over the tree tokens at positions r + depth. It reads the cache (slots
    < r) and writes nothing: the nodes attend to their ancestors through the tree mask, and
    Output.cache holds their new K/V ([B, N+1, G, K] per layer) for the accepted path alone to be
    written."""
    r = state.length
    n1 = trees.tokens.shape[1]
    slots = jnp.arange(shape.slots)[None, None, :]
    positions = r[:, None] + trees.depth  # [B, N+1]; committed tokens sit at slot = position
    mask = jnp.broadcast_to(slots < r[:, None, None], (r.shape[0], n1, shape.slots))
    if tcfg.sliding_window is not None:  # as in plain decoding: the last `window` positions
        mask = mask & (slots > positions[:, :, None] - tcfg.sliding_window)
    return tgt.forward(
        tparams,
        trees.tokens,
        positions,
        mask,
        tcfg,
        state.tcache,
        r,
        aux_ids=() if dcfg is None else dcfg.aux_layer_ids,
        mask_new=trees.mask,
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
    # last round's accepted K/V first: from here on this round only reads the target cache
    state = state._replace(tcache=_write_pending(state.tcache, state.pending_kv, state.pending_at))
    trees, dcache = drafter(dparams, embed, vocab, state, dcfg, shape, tree)
    key, sub = jax.random.split(state.key)
    r = state.length
    n1 = trees.tokens.shape[1]

    def check(size, trees=trees):
        """Steps 3-4 on the tree's best `size` nodes: verify, accept, gather the path's K/V."""
        if size < n1:
            trees = jax.vmap(prune_tree, in_axes=(0, None))(trees, size)
        tout = verify(tparams, trees, state, tcfg, dcfg, shape)
        acc, bonus = acceptance.accept(trees, tout.logits, sub, sampling, tree.depth, tree.top_k)
        # the accepted path's K/V [B, depth + 1, G, K] (padding repeats its last node)
        path_kv = _map_cache(
            lambda new: jnp.take_along_axis(new, acc.path[:, :, None, None], axis=1), tout.cache
        )
        path_next = jnp.take_along_axis(
            acc.path, jnp.minimum(jnp.arange(1, e + 1), tree.depth)[None], axis=1
        )
        path_tok = jnp.take_along_axis(trees.tokens, path_next, axis=1)
        enc_feat = (
            state.enc_feat
            if tout.aux is None
            else jnp.take_along_axis(tout.aux, acc.path[:, :, None], axis=1)
        )
        return acc.length, path_tok, bonus, path_kv, enc_feat

    sizes = tree.verify_sizes if n1 == tree.total_tokens else (n1,)
    if len(sizes) == 1:
        a, path_tok, bonus, path_kv, enc_feat = check(n1)
        verified = jnp.int32(n1)  # tree tokens the target ran this round
    else:
        # the smallest compiled size holding every node at or above the threshold, in every row
        passing = trees.score[:, 1:] >= float(np.log(tree.verify_threshold))
        need = jnp.max(jnp.where(running, 1 + jnp.sum(passing, axis=1), 1))
        which = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), need).astype(jnp.int32)
        branches = [functools.partial(lambda _, size: check(size), size=z) for z in sizes]
        a, path_tok, bonus, path_kv, enc_feat = jax.lax.switch(which, branches, None)
        verified = jnp.asarray(sizes, jnp.int32)[which]
    # emitted this round: the accepted drafted tokens, then the bonus
    j = jnp.arange(e)[None, :]
    emit = jnp.where(j < a[:, None], path_tok, bonus[:, None])
    is_eos = _eos_mask(emit, eos_ids) & (j <= a[:, None])
    has_eos = jnp.any(is_eos, axis=1)
    count = jnp.where(has_eos, jnp.argmax(is_eos, axis=1) + 1, a + 1)
    room = state.limit - state.num_new
    stop_eos = has_eos & (count <= room)
    count = jnp.minimum(count, room)
    length = r + a + 1
    no_room = length + tree.round_slots + 1 > shape.slots  # the next round would not fit
    finish = jnp.where(stop_eos, 1, jnp.where(count >= room, 2, jnp.where(no_room, 3, 0)))
    # writes past `count` are overwritten next round or lie beyond the row's final length
    tokens = state.tokens.at[rows[:, None], state.num_new[:, None] + j].set(emit)
    history = state.history.at[rows[:, None], jnp.minimum(r[:, None] + 1 + j, shape.slots - 1)].set(
        emit
    )
    upd = lambda new, old: jnp.where(running.reshape((b,) + (1,) * (new.ndim - 1)), new, old)  # noqa
    hist = state.accept_hist.at[rows, a].add(running.astype(jnp.int32))
    return SpecState(
        state.tcache,
        # the path goes to slots r .. r + depth next round (slots past r + a get padding, beyond
        # the new length: masked, then overwritten)
        path_kv,
        r,
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
        state.verified + verified * running,
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
    verified_tokens: list[int] | None = None  # per row: tree tokens verified over all rounds

    def rows(self) -> list[dict]:
        """Per row: output_ids, finish_reason, target_forwards, accept_hist (a list),
        verified_tokens."""
        verified = self.verified_tokens or [None] * len(self.output_ids)
        return [
            {
                "output_ids": o,
                "finish_reason": f,
                "target_forwards": fw,
                "accept_hist": np.asarray(h).tolist(),
                "verified_tokens": v,
            }
            for o, f, fw, h, v in zip(
                self.output_ids,
                self.finish_reasons,
                self.target_forwards,
                self.accept_hist,
                verified,
            )
        ]


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
    req = prepare(tcfg, prompts, max_new_tokens, eos_ids, max_context, pad_id, tree.round_slots + 1)
    embed = tparams["embed"] if embed is None else embed
    key = jax.random.PRNGKey(seed)
    args = (tcfg, dcfg, req.shape, tree, sampling, req.eos)
    inputs = (tparams, dparams, embed, vocab, req.tokens, req.lengths)
    mesh = mesh_of(tparams)
    if warmup:
        st = prefill(*inputs, np.ones_like(req.limit), key, *args, mesh=mesh)
        jax.block_until_ready(decode_loop(tparams, dparams, embed, vocab, st, *args, method))
    t0 = time.perf_counter()
    state = prefill(*inputs, req.limit, key, *args, mesh=mesh)
    state = decode_loop(tparams, dparams, embed, vocab, state, *args, method)
    tokens, n, finish, fw, hist, ver = jax.device_get(
        (
            state.tokens,
            state.num_new,
            state.finish,
            state.forwards,
            state.accept_hist,
            state.verified,
        )
    )
    wall = time.perf_counter() - t0
    return SpecResult(
        [list(map(int, tokens[i, : n[i]])) for i in range(len(n))],
        [FINISH_REASONS[f] for f in finish],
        [int(x) for x in fw],
        np.asarray(hist),
        wall,
        [int(x) for x in ver],
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
    req = prepare(tcfg, [prompt], max_new_tokens, eos_ids, max_context, 0, tree.round_slots + 1)
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
        mesh=mesh_of(tparams),
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
