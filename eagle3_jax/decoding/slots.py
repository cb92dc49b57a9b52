"""Continuous batching over fixed slots: the speculative engine's state for B slots, requests
admitted into free slots between rounds, every round one speculative round over the busy ones.

JetStream's engine contract on our engine: `admit` prefills ONE request (batch 1, its prompt
bucket) and writes its row into slot i of the batched `SpecState` (every field: both caches,
pending K/V, buffers, counters and the row's own PRNG key); `step` runs one round over the busy
slots, padded with free ones to a row bucket (`speculative.rows_round`, the target cache read in
place; all B: `speculative.round_step`), free and finished slots riding along frozen as a
finished row always does (`finish != 0`), and reports each occupied slot's new tokens and, when
it ended, why; `release` frees a slot before its end (a disconnect, a stop string). With
`DecodeOptions.prefill_chunk` C, `admit` reserves the slot and `step` prefills C tokens of it
before each round (`prefill_some`), the row joining the batch after its last chunk
(`admit_prefilled`): tokens as `decode --prefill-chunk C` gives them.

Static shapes: the batched state is sized once (`Shape(B, 0, S, M)`: S cache slots for every
request, M the largest max_tokens), so a round compiles once per tree and row bucket; `admit`
compiles once per prompt bucket (`plain.PROMPT_BUCKET`). A request's prompt length +
max_tokens + the tree's `round_slots` + 1 must fit in S (`check`), the room decoding alone
would give it, so no row stops for the context where decoding it alone would not.

Exactness: rows do not read each other, so a greedy request's tokens are those of decoding it
alone (`generate.generate_ids`, same tree, float32), whatever shares the batch and whenever it
arrived. Sampling: each request brings its own settings (temperature, top-k, top-p; kept per row
in the state, `sampling.RowSampling`: the round compiles once for all of them, a greedy row
getting exactly the greedy rule) and its own key ([B, 2] in the state), the request's `seed` as
decoding alone seeds its batch of one; a round splits each row's key as a batch of one would
split its key, so a sampled request draws what it would draw decoded alone with that seed and
those settings. Adaptive verification (`TreeConfig.verify_threshold` > 0) verifies the largest
need over the running rows, and a tree schedule (`TreeSchedule`) picks each round's tree from
the occupancy: greedy output is unchanged by either, but a sampled request's tree, hence its
tokens, then depend on the batch.

The tree per round: `MeasuredSchedule` picks, per number of occupied slots, the candidate tree
(or plain rounds: the root alone, `PLAIN`) that has given the most tokens per second of round
there, measured as the engine runs; `TreeSchedule` is a fixed table of the same. The state is
sized once for the largest (`envelope`: E = its depth + 1, the draft's scratch slots, the room a
round reserves), and each tree compiles its own round once; a smaller tree pads its accepted
path to E. With a head, plain rounds keep feeding the draft cache (`encode_drafter`: the new pairs wait in the
state's buffer and are encoded E at a time), so a later speculative round drafts from the whole
context.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import logging
import math
import os
import re
import statistics
import time
from collections.abc import Iterable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.checkpoints import Target
from eagle3_jax.checkpoints.heads import Head
from eagle3_jax.decoding import plain
from eagle3_jax.decoding import speculative as spec
from eagle3_jax.decoding.drafters import encode_drafter, method_head_tree, method_tree
from eagle3_jax.decoding.generate import DecodeOptions
from eagle3_jax.decoding.sampling import Penalties, RowSampling, Sampling
from eagle3_jax.decoding.state import SpecState, TokenLogProbs
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.decoding.verify import token_logprobs
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.models import target as tgt
from eagle3_jax.sharding import mesh_of, named

log = logging.getLogger(__name__)

_STATIC = ("tcfg", "dcfg", "shape", "tree", "sampling", "eos_ids")
# the static sampling of the engine's programs: rows may sample (each row's settings are in the
# state); a batch of greedy rows skips the sampling code at run time (`verify.accept`)
ROWS_SAMPLE = Sampling(temperature=1.0)
PLAIN = TreeConfig(top_k=1, depth=1, total_tokens=1)  # the root alone: a plain decoding step
# a request's logit_bias entries and the ids min_tokens bars (EOS and its stop token ids) each
# row keeps room for (`RowSampling`; static)
ROW_WIDTHS = (300, 16)


def row_widths(vocab_size: int) -> tuple[int, int, int]:
    """A serving state's `Shape.row_widths`: `ROW_WIDTHS` and the penalties' token counts."""
    return (*ROW_WIDTHS, vocab_size)


def tree_name(tree: TreeConfig) -> str:
    """The tree's name: plain, or top_k/depth/total_tokens (/threshold if adaptive)."""
    if tree.total_tokens == 1:
        return "plain"
    name = f"{tree.top_k}/{tree.depth}/{tree.total_tokens}"
    return name + (f"/{tree.verify_threshold:g}" if tree.verify_threshold > 0 else "")


@dataclasses.dataclass(frozen=True)
class TreeSchedule:
    """The tree of a round by the number of occupied slots: `ranges` are (lo, hi, tree), hi
    None for no upper bound; an occupancy no range covers gets `default`."""

    ranges: tuple[tuple[int, int | None, TreeConfig], ...]
    default: TreeConfig

    @classmethod
    def parse(cls, text: str, default: TreeConfig) -> TreeSchedule:
        """A schedule from text such as 1-2:10/8/60,3-4:1/4/5,5-:plain: occupancy ranges (lo-hi,
        lo- or n), each with a tree top_k/depth/total_tokens[/verify threshold] (the threshold
        default: `default`'s) or `plain` (the root alone)."""
        ranges = []
        for part in filter(None, (x.strip() for x in text.split(","))):
            m = re.fullmatch(r"(\d+)(-(\d*))?:(plain|\d+/\d+/\d+(/[0-9.]+)?)", part)
            if not m:
                raise Eagle3Error(
                    f"--tree-by-occupancy: {part!r} is not RANGE:TREE (e.g. 1-2:10/8/60, 5-:plain)"
                )
            lo = int(m[1])
            hi = lo if m[2] is None else (int(m[3]) if m[3] else None)
            if lo < 1 or (hi is not None and hi < lo):
                raise Eagle3Error(f"--tree-by-occupancy: bad range in {part!r}")
            if m[4] == "plain":
                tree = PLAIN
            else:
                k, d, n, *thr = m[4].split("/")
                t = float(thr[0]) if thr else default.verify_threshold
                tree = TreeConfig(int(k), int(d), int(n), t)
            ranges.append((lo, hi, tree))
        return cls(tuple(ranges), default)

    def tree_for(self, occupied: int) -> TreeConfig:
        for lo, hi, tree in self.ranges:
            if lo <= occupied and (hi is None or occupied <= hi):
                return tree
        return self.default

    def trees(self) -> list[TreeConfig]:
        return list(dict.fromkeys([t for _, _, t in self.ranges] + [self.default]))


def envelope(trees: list[TreeConfig]) -> TreeConfig:
    """The tree a state is sized for so that every one of `trees` runs on it: the largest depth
    (E), top_k x depth (the draft's scratch slots) and total (the room a round reserves). Only
    its sizes are read (not a tree to draft: it may not validate)."""
    if len(trees) == 1:
        return trees[0]
    return TreeConfig(
        top_k=max(t.top_k for t in trees),
        depth=max(t.depth for t in trees),
        total_tokens=max(t.total_tokens for t in trees),
    )


def insert_row(state: SpecState, row: SpecState, slot: jax.Array) -> SpecState:
    """`state` (B rows) with row `slot` replaced by `row`'s (a batch of one, its key [2]). Each
    field's batch axis is the one where the two shapes differ (0, or 1 for [L, B, ...] stacked
    caches and pending K/V), so any field of SpecState, either cache layout, goes the same way."""
    row = dataclasses.replace(row, key=row.key[None])

    def put(big, small):
        if big.shape == small.shape:  # B == 1
            return small.astype(big.dtype)
        diff = [i for i, (a, b) in enumerate(zip(big.shape, small.shape)) if a != b]
        assert big.ndim == small.ndim and len(diff) == 1 and small.shape[diff[0]] == 1, (
            big.shape,
            small.shape,
        )
        return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, diff[0])

    return jax.tree.map(put, state, row)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnums=4)
def admit_row(
    tparams, dparams, embed, vocab, state: SpecState, slot, prompt_1T, length_1, limit_1, key,
    tcfg, dcfg, shape: plain.Shape, tree, sampling, eos_ids, rows: RowSampling | None = None,
) -> SpecState:  # fmt: skip
    """One request's prefill (prompt_1T [1, T] right-padded, length_1 and limit_1 [1], key [2],
    rows its sampling settings [1]; `shape` the batch of one's: its prompt bucket, the slots' S
    and M) written into row `slot` ([] int32, a runtime value: no compile per slot) of the
    batched state, which is donated."""
    row = spec.prefill(tparams, dparams, embed, vocab, prompt_1T, length_1, limit_1, key,
                       tcfg, dcfg, shape, tree, sampling, eos_ids, row_sampling=rows)  # fmt: skip
    return insert_row(state, row, slot)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnums=3)
def admit_prefilled(
    tparams, dparams, embed, state: SpecState, slot, cache, aux, logits, prompt_1T, length_1,
    limit_1, key, tcfg, dcfg, shape: plain.Shape, tree, sampling, eos_ids,
    rows: RowSampling | None = None,
) -> SpecState:  # fmt: skip
    """A chunked admission's end (`SlotEngine` with prefill_chunk): the row's state from its
    prompt's chunks (`plain.prefill_chunk`'s cache, aux features and last logits: the root
    sampled, the draft's encode, as `speculative.prefill_chunked` ends) written into row `slot`
    of the batched state, which is donated."""
    row = spec.from_prefill(tparams, dparams, embed, cache, aux, logits, prompt_1T, length_1,
                            limit_1, key, tcfg, dcfg, shape, tree, sampling, eos_ids,
                            rows)  # fmt: skip
    return insert_row(state, row, slot)


@dataclasses.dataclass
class _Staged:
    """A request whose prompt is being prefilled chunk by chunk (`SlotEngine.prefill_chunk`):
    its slot is reserved, its row not yet in the batched state."""

    request: object
    slot: int
    args: tuple  # `admit_prefilled`'s prompt_1T, length_1, limit_1, key
    shape: plain.Shape  # the batch of one's
    rows: RowSampling
    sizes: list[int]  # its chunks (`plain.chunk_sizes`)
    pre: plain.Prefilled | None = None  # the cache, aux features and logits so far
    done: int = 0  # chunks run (or restored from the prefix cache)
    keys: list[bytes] = dataclasses.field(default_factory=list)  # its full chunks' prefix keys

    @property
    def at(self) -> int:
        return sum(self.sizes[: self.done])


class PrefixCache:
    """Prompts' chunks kept for later prompts that begin the same way (`SlotEngine`'s
    prefix_cache_bytes, `serve --prefix-cache-mb`): an entry is chunk i of a chunked prefill,
    its K/V (`plain.take_chunk`) and aux features, keyed by the SHA-256 of the prompt's first
    (i + 1) C tokens (a chunk's K/V depend on every token before it). Only whole chunks before
    a prompt's last are kept (the last holds the logits the root is sampled from). Restored
    (`plain.put_chunk`) into a fresh row, a prefix's chunks are bit for bit what computing them
    gives (the same program on the same inputs, the cache before them restored alike), so a
    request's tokens do not depend on what was cached. The least recently used entries go
    once the entries pass `budget` bytes, a prompt's deeper chunks before its earlier ones (an
    entry is usable only after every chunk before it: touching a prompt's chunks refreshes
    them deepest first, so its first chunk is the last of them to go)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.entries: collections.OrderedDict[bytes, tuple] = collections.OrderedDict()
        self.bytes = 0
        self.query_tokens = 0  # prompt tokens in whole chunks looked up
        self.hit_tokens = 0  # of which restored

    @staticmethod
    def keys(prompt: list[int], chunk: int, count: int) -> list[bytes]:
        """The keys of the prompt's first `count` chunks of `chunk` tokens."""
        h, out = hashlib.sha256(), []
        for i in range(count):
            h.update(np.asarray(prompt[i * chunk : (i + 1) * chunk], np.int32).tobytes())
            out.append(h.copy().digest())
        return out

    def lookup(self, keys: list[bytes], chunk: int) -> list[tuple]:
        """The entries of the longest run of `keys` from the first that is kept, each marked
        just used; counted in query_tokens / hit_tokens."""
        got = []
        for k in keys:
            entry = self.entries.get(k)
            if entry is None:
                break
            got.append(entry)
        self._touch(keys[: len(got)])
        self.query_tokens += len(keys) * chunk
        self.hit_tokens += len(got) * chunk
        return got

    def _touch(self, keys: list[bytes]) -> None:
        """Marks a prompt's kept chunks (`keys`, first to deepest) just used, deepest first."""
        for k in reversed(keys):
            if k in self.entries:
                self.entries.move_to_end(k)

    def put(self, keys: list[bytes], kv, aux) -> None:
        """Keeps a chunk's (K/V, aux features) under the last of `keys` (the prompt's chunks up
        to it), its earlier chunks refreshed after it (`_touch`), dropping the least recently
        used entries past the budget (one larger than the budget is not kept)."""
        key = keys[-1]
        size = sum(x.nbytes for x in jax.tree.leaves((kv, aux)))
        if key not in self.entries and size <= self.budget:
            self.entries[key] = (kv, aux, size)
            self.bytes += size
        self._touch(keys)
        while self.bytes > self.budget:
            self.bytes -= self.entries.popitem(last=False)[1][2]


SCORE_CHUNK = 64  # prompt positions whose logits `score_prompt` computes at once


@functools.partial(jax.jit, static_argnames=("tcfg", "k"))
def score_prompt(tparams, prompt_1T, tcfg, k: int) -> TokenLogProbs:
    """Each prompt token's log-probability under the target given the tokens before it, and
    the k most likely tokens there (`TokenLogProbs` [T]): position t scores token t + 1 (the
    last position scores padding). The prompt's one causal pass keeps no cache; its logits are
    computed SCORE_CHUNK positions at a time (T a multiple of it), so that [T, V] fp32 logits
    (4 GB for 8,192 positions of a 128k vocabulary) never exist at once."""
    t = prompt_1T.shape[1]
    q = jnp.arange(t, dtype=jnp.int32)
    out = tgt.forward(tparams, prompt_1T, q[None], (q[None, :] <= q[:, None])[None], tcfg,
                      compute_logits=False)  # fmt: skip
    following = jnp.concatenate([prompt_1T[0, 1:], jnp.zeros((1,), jnp.int32)])

    def chunk(args):
        hidden_CD, tokens_C = args
        return token_logprobs(tgt.lm_head(tparams, hidden_CD, tcfg)[None], tokens_C[None], k)

    n = t // SCORE_CHUNK
    got = jax.lax.map(chunk, (out.hidden[0].reshape(n, SCORE_CHUNK, -1),
                              following.reshape(n, SCORE_CHUNK)))  # fmt: skip
    return TokenLogProbs(*(x.reshape((t,) + x.shape[3:]) for x in got))


@functools.partial(jax.jit, donate_argnums=0)
def _free_row(state: SpecState, slot) -> SpecState:
    """Row `slot` marked finished (frozen from the next round on), and greedy (`_greedy_row`)."""
    return _greedy_row(dataclasses.replace(state, finish=state.finish.at[slot].set(2)), slot)


# a finished or free row's settings (`RowSampling` fields): greedy, no penalties
QUIET = {"temperature": 0.0, **dataclasses.asdict(Penalties())}


def _greedy_row(state: SpecState, slot) -> SpecState:
    """Row `slot` at temperature 0 and without penalties: a finished or free row's settings must
    not keep a batch of greedy requests on the sampling branch (`verify.accept` skips it only
    when no row samples) or the penalties' pass on (`sampling.process_logits`)."""
    rows = state.sampling
    cold = {f: getattr(rows, f).at[slot].set(v) for f, v in QUIET.items()}
    return dataclasses.replace(state, sampling=dataclasses.replace(rows, **cold))


def state_shapes(models: tuple, tcfg, dcfg, shape: plain.Shape, tree: TreeConfig,
                 eos_ids: tuple[int, ...]) -> SpecState:  # fmt: skip
    """The arrays' shapes and dtypes of a serving state of `shape.batch` slots: a prefill's
    state, with a PRNG key per row. `models`: (target params, head params, embedding, draft
    vocabulary), concrete or abstract."""
    b = shape.batch
    one = dataclasses.replace(shape, prompt_len=1)
    shapes = jax.eval_shape(
        lambda *arrays: spec.prefill(*arrays, tcfg, dcfg, one, tree, ROWS_SAMPLE, eos_ids),
        *models, jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32),
        jnp.ones((b,), jnp.int32), jax.random.PRNGKey(0),
    )  # fmt: skip
    return dataclasses.replace(
        shapes, key=jax.ShapeDtypeStruct((b,) + shapes.key.shape, shapes.key.dtype)
    )


def state_shardings(shapes: SpecState, tcfg, dcfg, mesh, slots: int):
    """A serving state's layout on `mesh` (shapes: its `SpecState` of B = `slots` rows): the
    target cache as decoding lays it out (`target.cache_sharding`: kv heads over `model`, rows
    over `data`), the draft's as its own (`draft.cache_sharding`), and every other field's rows
    over `data`, each where the axis divides it (else replicated), so a round's work is split as
    decoding's is."""
    out = jax.tree.map(lambda x: named(mesh, ("batch",) + (None,) * (x.ndim - 1), x.shape),
                       shapes)  # fmt: skip
    stacked = not isinstance(shapes.tcache["k"], list)
    pending = {n: named(mesh, (None, "batch", None, "kv_heads", None), x.shape)
               for n, x in shapes.pending_kv.items()}  # fmt: skip
    fields = dict(tcache=tgt.cache_sharding(tcfg, mesh, slots, stacked=stacked),
                  pending_kv=pending)  # fmt: skip
    if dcfg is not None:
        fields["dcache"] = drf.cache_sharding(dcfg, mesh, slots)
    return dataclasses.replace(out, **fields)


def _map_trees(schedule, fn):
    if isinstance(schedule, MeasuredSchedule):
        return MeasuredSchedule(list(dict.fromkeys(fn(t) for t in schedule.candidates)),
                                **schedule.settings)  # fmt: skip
    ranges = tuple((lo, hi, fn(t)) for lo, hi, t in schedule.ranges)
    return TreeSchedule(ranges, fn(schedule.default))


class MeasuredSchedule:
    """The tree of a round by the number of occupied slots, chosen by measurement: for each
    occupancy the candidate (a tree, or `PLAIN`) that has given the most tokens per second of
    round there. Each candidate is tried `min_rounds` times at an occupancy before the choice
    settles; after that another candidate runs again once `explore_every` rounds at that
    occupancy have passed since its last, times its shortfall in tenths (with 16: a candidate
    up to 15 % slower every 16 rounds, 20 % every 32, 50 % every 80, 75 % or more every 128),
    so a change (longer contexts, a neighbour on the machine, other prompts) moves the choice
    while a clearly worse candidate costs under ~1 % of the rounds.

    A candidate's rate at n busy slots is n x its tokens per busy row and round over its seconds
    per round at n. The seconds are the median of its first 1 / `smoothing` rounds at that
    occupancy, then a mean exponentially weighted (`smoothing` on the newest) where a round
    counts at most 3 times the mean, so that a few slow first rounds (a first run of adaptive
    verification's branches was once measured 150-300 ms slower on the CPU; after serve's
    warm-up it was not reproduced: docs/experiments/2026-12-07-serving-measured-choice.md) are
    not taken for the tree's cost; the tokens per row are the candidate's over every occupancy,
    forgotten at `tau_smoothing` a row and round: a round's accepted tokens vary far more than
    its time (0-4 of a 2/3/4 tree's), and pooled over the occupancies they are known from many
    more rounds, where one occupancy's own rounds left a 10 % lead within the estimate's noise.
    The settled choice changes only for a lead of more than `margin`. A candidate's tries are
    spaced by its shortfall at its tokens per row two standard errors up, and come every
    `explore_every` / 4 rounds while that hopeful rate is not short at all, so a few unlucky
    first rounds neither keep a better tree out for 128 rounds at a time nor leave it to a try
    every 16.

    Why measured: a round's cost depends on the backend, the slots, the context and, with
    adaptive verification, on how many rows are busy; its tokens on the head and the prompts.
    On the project's 2-core CPU with 4 slots the CPU default tree and plain rounds come within
    ~10 % of each other (docs/serving.md); on a GPU the round is memory-bound and trees pay: a
    table written for one machine is wrong on the next. Greedy output is the same whichever
    tree runs (`SlotEngine`)."""

    def __init__(self, candidates: list[TreeConfig], min_rounds: int = 3,
                 explore_every: int = 16, smoothing: float = 0.05,
                 margin: float = 0.02, tau_smoothing: float = 0.005):  # fmt: skip
        if not candidates:
            raise Eagle3Error("a measured schedule needs at least one candidate tree")
        if (min_rounds < 1 or explore_every < 2 or not 0 < smoothing <= 1 or margin < 0
                or not 0 < tau_smoothing <= 1):  # fmt: skip
            raise Eagle3Error("a measured schedule needs min_rounds >= 1, explore_every >= 2, "
                              "0 < smoothing <= 1, 0 < tau_smoothing <= 1 and margin >= 0")  # fmt: skip
        self.candidates = list(dict.fromkeys(candidates))
        self.min_rounds, self.explore_every, self.smoothing = min_rounds, explore_every, smoothing
        self.margin, self.tau_smoothing = margin, tau_smoothing
        # (occupancy, tree) -> [rounds seen, seconds per round, the first rounds' seconds]
        self.stats: dict[tuple[int, TreeConfig], list[float]] = {}
        # tree -> [tokens, sum of squared tokens per row, busy rows x rounds], forgotten at
        # tau_smoothing a row and round
        self.emitted: dict[TreeConfig, list[float]] = {}
        self._rounds: collections.Counter = collections.Counter()  # rounds run per occupancy
        self._last: dict[tuple[int, TreeConfig], int] = {}  # the round a candidate last ran
        self.best: dict[int, TreeConfig] = {}  # the settled choice per occupancy (logged)

    @classmethod
    def parse(cls, text: str, default: TreeConfig) -> MeasuredSchedule:
        """`auto` (the tree flags' tree and plain rounds) or `auto:TREE,TREE,...` (the listed
        candidates: top_k/depth/total_tokens[/threshold] or plain)."""
        _, _, listed = text.partition(":")
        if not listed.strip():
            return cls([default, PLAIN])
        trees = []
        for part in filter(None, (x.strip() for x in listed.split(","))):
            try:
                trees.append(TreeSchedule.parse(f"1-:{part}", default).ranges[0][2])
            except Eagle3Error:
                raise Eagle3Error(f"--tree-by-occupancy auto: {part!r} is not a tree: give "
                                  "top_k/depth/total_tokens[/threshold] or plain") from None  # fmt: skip
        return cls(trees)

    def trees(self) -> list[TreeConfig]:
        return list(self.candidates)

    @property
    def settings(self) -> dict:
        """The constructor's arguments but the candidates."""
        return dict(min_rounds=self.min_rounds, explore_every=self.explore_every,
                    smoothing=self.smoothing, margin=self.margin,
                    tau_smoothing=self.tau_smoothing)  # fmt: skip

    def tokens_per_row(self, tree: TreeConfig, hopeful: bool = False) -> float | None:
        """The tokens a busy row gets from a round of `tree`, over every occupancy (None:
        unseen); `hopeful`: two standard errors above (a candidate seen in few rounds is not
        written off on them)."""
        got = self.emitted.get(tree)
        if not got or got[2] <= 0:
            return None
        mean = got[0] / got[2]
        if not hopeful:
            return mean
        return mean + 2 * math.sqrt(max(got[1] / got[2] - mean * mean, 0.0) / got[2])

    def rate(self, occupied: int, tree: TreeConfig, hopeful: bool = False) -> float | None:
        """The measured tokens per second of `tree`'s rounds at this occupancy (None: unseen);
        `hopeful`: with `tokens_per_row(hopeful=True)`, which spaces a candidate's tries."""
        st, per_row = self.stats.get((occupied, tree)), self.tokens_per_row(tree, hopeful)
        if not st or st[0] == 0 or st[1] <= 0 or per_row is None:
            return None
        return occupied * per_row / st[1]

    def tree_for(self, occupied: int) -> TreeConfig:
        seen = {t: self.stats.get((occupied, t), [0])[0] for t in self.candidates}
        young = [t for t in self.candidates
                 if seen[t] < self.min_rounds or self.tokens_per_row(t) is None]  # fmt: skip
        if young:  # every candidate measured first, the least seen next
            return min(young, key=lambda t: seen[t])
        best = max(self.candidates, key=lambda t: self.rate(occupied, t))
        held = self.best.get(occupied)
        if held is not None and self.rate(occupied, best) <= (1 + self.margin) * self.rate(
            occupied, held
        ):
            best = held  # a lead within the margin is noise: the choice stays
        if best != held:
            others = ", ".join(f"{tree_name(t)} {self.rate(occupied, t):.1f}"
                               for t in self.candidates if t != best)  # fmt: skip
            log.info("occupancy %d: %s rounds (%.1f tok/s; %s)", occupied, tree_name(best),
                     self.rate(occupied, best), others)  # fmt: skip
            self.best[occupied] = best
        n, top = self._rounds[occupied], self.rate(occupied, best)
        rest = sorted((t for t in self.candidates if t != best),
                      key=lambda t: self._last.get((occupied, t), -1))  # fmt: skip
        for t in rest:  # the stalest candidate due for another try, if any
            rate = self.rate(occupied, t, hopeful=True)
            gap = top / rate - 1 if rate and rate > 0 else math.inf
            if gap <= 0:  # it may yet be ahead: tried 4 times as often
                period = max(2, self.explore_every // 4)
            else:
                period = self.explore_every * min(8, max(1, round(10 * gap)))
            if n - self._last.get((occupied, t), -1) >= period:
                return t
        return best

    def observe(self, occupied: int, tree: TreeConfig, tokens: int, seconds: float,
                capped: bool = False) -> None:  # fmt: skip
        """One round's outcome: `tokens` emitted by `occupied` busy slots in `seconds`;
        `capped`: a row stopped at its max_tokens or the context, so the round's tokens say
        less of the tree than of the request (timed, but not in the tokens per row: a sweep's
        requests of 2 tokens made every tree look like plain rounds)."""
        st = self.stats.setdefault((occupied, tree), [0, 0.0, []])
        st[0] += 1
        if st[0] <= 1 / self.smoothing:  # the median of the first rounds
            st[2].append(seconds)
            st[1] = statistics.median(st[2])
        else:  # then weighted, a round counted at most 3 times the mean
            st[2] = []
            st[1] += self.smoothing * (min(seconds, 3 * st[1]) - st[1])
        self._last[(occupied, tree)] = self._rounds[occupied]
        self._rounds[occupied] += 1
        if capped:
            return
        got = self.emitted.setdefault(tree, [0.0, 0.0, 0.0])  # tokens, their squares, rows
        keep = (1.0 - self.tau_smoothing) ** occupied
        per_row = tokens / occupied
        got[0] = got[0] * keep + tokens
        got[1] = got[1] * keep + occupied * per_row * per_row
        got[2] = got[2] * keep + occupied


def _compile_ahead(calls: list[tuple], threads: int = 0) -> int:
    """Lowers and compiles each (jitted function, its arguments) of `calls` without running
    it, `threads` at once (default: one per CPU); returns how many."""
    with concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        list(pool.map(lambda call: call[0].lower(*call[1]).compile(), calls))
    return len(calls)


class Update(NamedTuple):
    """What one occupied slot produced since the last report."""

    slot: int
    request: object  # the id the caller admitted it with
    new_ids: list[int]  # tokens emitted since the last report
    finish_reason: str | None  # "eos", "max_tokens" or "context" once the request ended, else None
    num_tokens: int  # tokens emitted so far in all
    target_forwards: int  # target passes so far, its prefill's included
    # with the engine's max_logprobs: each new token's (log-probability, [(id, log-probability)
    # of the max_logprobs most likely]) under the target
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class SlotEngine:
    """B slots of the speculative engine (`method` "eagle3", "pld" or "vanilla": plain rounds,
    the root alone verified), driven from one thread: `admit` into a free slot, `step` a round.

    Args:
      target, head: as `generate_ids` takes them (head None for pld and vanilla).
      opts: the engine's method, tree, EOS ids and pad id; `sampling` is a request's default
        (`admit` takes its own); `max_context` is S, the cache slots every request gets
        (default the target's context), and `max_new_tokens` the largest max_tokens a request
        may ask for. `seed` is unused: a request brings its own.
      slots: B, the requests decoded together.
      schedule: the tree of each round by occupancy (`TreeSchedule`, a table, or
        `MeasuredSchedule`, measured as it serves; None: `opts.tree` always). Its trees are
        checked against the head as `opts.tree` is; ignored by method vanilla.
      busy_rows: a round runs over the busy slots only, padded with free ones to the next of
        `row_buckets` (`speculative.rows_round`: the target cache read in place), so its cost
        follows the occupancy; False: every round over all B slots.
      max_logprobs: each emitted token's log-probability under the target and its
        `max_logprobs` most likely alternatives kept and reported (`Update.logprobs`; a
        log-softmax and a top-k over the vocabulary at each emitted token); None: none. They
        are the target's own, before a request's logit_bias and min_tokens (vLLM's default).
      processing: room in the state for a request's logit processing (`RowSampling`): 300
        logit_bias entries, 16 ids barred until min_tokens, and each token's count for the
        penalties ([B, V] int32 and bool); False: none (every request refused that asks).
      opts.prefill_chunk: C > 0 prefills a prompt C tokens at a time, at most C tokens before
        each round while others decode (`step`, `prefill_some`), so a
        long prompt's arrival stalls a round by one chunk's forward, not its whole prefill;
        its slot is reserved meanwhile and its tokens are those of `decode --prefill-chunk C`
        (the same programs: `plain.prefill_chunk`, `admit_prefilled`). 0: each admission one
        pass (`admit_row`), tokens as `decode` without chunks.
      prefix_cache_bytes: with prefill_chunk, keep prompts' whole chunks up to this many bytes
        and restore those a new prompt begins with instead of computing them (`PrefixCache`:
        the tokens stay `decode --prefill-chunk C`'s); 0: none.
    """

    def __init__(self, target: Target, head: Head | None, opts: DecodeOptions, slots: int,
                 schedule: TreeSchedule | MeasuredSchedule | None = None,
                 busy_rows: bool = True, max_logprobs: int | None = None,
                 processing: bool = True, prefix_cache_bytes: int = 0):  # fmt: skip
        if slots < 1:
            raise Eagle3Error(f"slots {slots} < 1")
        if prefix_cache_bytes < 0 or prefix_cache_bytes and not opts.prefill_chunk:
            raise Eagle3Error("a prefix cache keeps prefill chunks: give --prefill-chunk too "
                              "(and a size >= 0)")  # fmt: skip
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        self.prefill_chunk = opts.prefill_chunk
        self.staged: dict[int, _Staged] = {}  # slot -> its chunked admission, in arrival order
        # a round runs the busy slots (`row_buckets`) or all B
        self.busy_rows = busy_rows
        method = opts.method
        head, tree = method_head_tree(method, head, opts.tree)
        dparams, dcfg, vocab, embed = head or (None, None, None, None)
        if schedule is None or method == "vanilla":
            schedule = TreeSchedule((), tree)
        elif method != "eagle3":  # pld: a chain of each tree's depth, or plain rounds
            schedule = _map_trees(
                schedule, lambda t: t if t == PLAIN else method_tree(method, t, 1)
            )
        else:
            choices = dcfg.draft_choices
            schedule = _map_trees(schedule, lambda t: t if t == PLAIN else t.validate(choices))
        self.schedule = schedule
        self.tree = envelope(schedule.trees())  # the state's sizes: every tree runs on it
        self.current_tree: TreeConfig | None = None  # the last round's
        self.tree_rounds: collections.Counter = collections.Counter()  # rounds by tree_name
        tcfg = target.cfg
        context = opts.max_context or tcfg.max_position_embeddings
        cache = plain.round_up(context, plain.PROMPT_BUCKET)  # a prompt bucket always fits
        self.method, self.opts, self.slots = method, opts, slots
        self.pad = (tcfg.pad_token_id or 0) if opts.pad_id is None else opts.pad_id
        self.eos = tuple(tcfg.eos_token_ids if opts.eos_ids is None else opts.eos_ids)
        new_buffer = plain.round_up(opts.max_new_tokens, plain.NEW_BUCKET)
        if max_logprobs is not None and max_logprobs < 0:
            raise Eagle3Error(f"max_logprobs {max_logprobs} < 0")
        self.shape = plain.Shape(slots, 0, cache, new_buffer, logprobs=max_logprobs,
                                 row_widths=row_widths(tcfg.vocab_size) if processing
                                 else (0, 0, 0))  # fmt: skip
        self.models = (target.params, dparams, target.params["embed"] if embed is None else embed,
                       vocab)  # fmt: skip
        self.cfgs = (tcfg, dcfg)
        self.mesh = mesh_of(target.params)  # None on one device
        self.state = self._empty()
        self.owner: list[object | None] = [None] * slots
        self.shown = [0] * slots
        self.rounds = 0  # rounds run

    # ------------------------------------------------------------------ static sizes, checks

    @property
    def max_context(self) -> int:
        """S: cache slots of every request."""
        return self.shape.slots

    def max_tokens_for(self, prompt_len: int) -> int:
        """The most new tokens a prompt of this length may ask for (0: the prompt does not fit)."""
        room = self.shape.slots - prompt_len - self.tree.round_slots - 1
        return max(0, min(room, self.opts.max_new_tokens))

    def check(self, prompt: list[int], max_tokens: int) -> None:
        """Raises Eagle3Error naming the problem when the request cannot be decoded here."""
        if not prompt:
            raise Eagle3Error("empty prompt: give at least one token")
        if max_tokens < 1:
            raise Eagle3Error(f"max_tokens {max_tokens} < 1")
        if max_tokens > self.opts.max_new_tokens:
            raise Eagle3Error(f"max_tokens {max_tokens} exceeds this server's limit of "
                              f"{self.opts.max_new_tokens}")  # fmt: skip
        if max_tokens > self.max_tokens_for(len(prompt)):
            raise Eagle3Error(
                f"prompt of {len(prompt)} tokens + {max_tokens} new tokens exceeds the context of "
                f"{self.shape.slots} (less {self.tree.round_slots + 1} slots a round reserves): "
                "shorten the prompt or lower max_tokens"
            )

    # ------------------------------------------------------------------ the state

    def _static(self, shape: plain.Shape, tree: TreeConfig | None = None) -> tuple:
        return (*self.cfgs, shape, tree or self.tree, ROWS_SAMPLE, self.eos)

    def _empty(self) -> SpecState:
        """B free slots: zeros of the batched state's shapes, every row finished (frozen), laid
        out on the target's mesh where it has one (`state_shardings`)."""
        b = self.slots
        shapes = state_shapes(self.models, *self.cfgs, self.shape, self.tree, self.eos)
        state = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
        state = dataclasses.replace(
            state,
            finish=np.full((b,), 2, np.int32),
            length=np.ones((b,), np.int32),
            enc_n=np.ones((b,), np.int32),
            # greedy, no processing: a free row turns on neither the sampling branch nor the
            # penalties' pass (zeros would be a repetition penalty of 0)
            sampling=jax.device_get(RowSampling.fill(Sampling(), b, self.shape.row_widths)),
        )
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, state)
        return jax.device_put(state, self.state_shardings(shapes))

    def state_shardings(self, shapes: SpecState):
        """The batched state's layout on the target's mesh (`state_shardings`)."""
        return state_shardings(shapes, *self.cfgs, self.mesh, self.slots)

    def row_buckets(self) -> list[int]:
        """The row counts a round runs over, one compiled round each per tree: the powers of
        two below B, and B (with busy_rows; else B alone)."""
        if not self.busy_rows:
            return [self.slots]
        return sorted({min(2**i, self.slots) for i in range(self.slots.bit_length() + 1)})

    def round_rows(self, running: list[int]) -> list[int] | None:
        """The slots a round over `running` runs: those, and free ones up to the next row
        bucket; None for all B (the plain round, no rows taken)."""
        size = next(n for n in self.row_buckets() if n >= len(running))
        if size == self.slots:
            return None
        pad = [i for i in range(self.slots) if i not in running][: size - len(running)]
        return sorted(running + pad)

    def _method_for(self, tree: TreeConfig):
        """The drafter a round of `tree` runs: PLAIN is the root alone, a head still encoding."""
        if tree == PLAIN and self.method != "vanilla":
            return encode_drafter if self.method == "eagle3" else "vanilla"
        return self.method

    def _round_call(self, tree: TreeConfig, rows: list[int] | None):
        """(the jitted round, its arguments) for `tree` over `rows` (None: all B)."""
        static = (*self._static(self.shape, tree), self._method_for(tree))
        if rows is None:
            return spec.round_step, (*self.models, self.state, *static)
        return spec.rows_round, (*self.models, self.state, jnp.asarray(rows, jnp.int32), *static)

    def compile_rounds(self, threads: int = 0) -> int:
        """Compiles the round of every tree of the schedule at every row bucket ahead of time
        (as `compile_admissions` does the admissions); returns how many programs."""
        return _compile_ahead([self._round_call(t, None if n == self.slots else list(range(n)))
                               for t in self.schedule.trees() for n in self.row_buckets()],
                              threads)  # fmt: skip

    def free_slots(self) -> list[int]:
        return [i for i, o in enumerate(self.owner) if o is None and i not in self.staged]

    def busy(self) -> int:
        return self.slots - len(self.free_slots())

    def admit(self, request: object, prompt: list[int], max_tokens: int, seed: int = 0,
              slot: int | None = None, sampling: Sampling | None = None,
              ignore_eos: bool = False, logit_bias: dict[int, float] | None = None,
              min_tokens: int = 0, stop_ids: Iterable[int] = ()) -> int:  # fmt: skip
        """Prefills `prompt` into a free slot (the first, or `slot`) for `max_tokens` new tokens
        at most, sampled as `sampling` says (default `opts.sampling`; temperature 0: greedy)
        from `seed`, going on past EOS with `ignore_eos`; returns the slot. `request` is the
        caller's id for it in `step`'s updates. The target's logits get `logit_bias` ({token
        id: bias}) added, EOS (unless ignored) and `stop_ids` barred until `min_tokens` tokens
        are out, and the sampling's penalties (vLLM's settings; `check_processing`)."""
        self.check(prompt, max_tokens)
        free = self.free_slots()
        if not free:
            raise Eagle3Error("no free slot")
        slot = free[0] if slot is None else slot
        if self.owner[slot] is not None or slot in self.staged:
            raise Eagle3Error(f"slot {slot} is busy")
        sampling = self.opts.sampling if sampling is None else sampling
        args = self._admit_args(
            slot, prompt, max_tokens, seed, sampling, ignore_eos,
            self.check_processing(max_tokens, logit_bias, min_tokens, stop_ids, ignore_eos,
                                  sampling.penalties),
        )  # fmt: skip
        if self.prefill_chunk:  # prefilled chunk by chunk from the next `step` on
            job = self._stage(request, slot, args)
            if self.prefix is not None:
                self._restore(job, prompt)
            self.staged[slot] = job
            return slot
        self.state = admit_row(*args)
        self.owner[slot], self.shown[slot] = request, 0
        return slot

    def _stage(self, request: object, slot: int, args: tuple) -> _Staged:
        """A chunked admission of `admit_row`'s arguments (`_admit_args`), no chunk run yet."""
        one = args[12]  # the batch of one's shape
        return _Staged(request, slot, args[6:10], one, args[-1],
                       plain.chunk_sizes(one.prompt_len, self.prefill_chunk))  # fmt: skip

    def _fresh_row(self) -> plain.Prefilled:
        """Empty buffers for one prompt's chunks: a batch of one's cache of the slots' S."""
        return plain.start_prefill(self.models[0], self.cfgs[0], 1, self.shape.slots, self.mesh)

    def _restore(self, job: _Staged, prompt: list[int]) -> None:
        """`job` started from the prefix cache's chunks its prompt begins with, if any."""
        c, tcfg = self.prefill_chunk, self.cfgs[0]
        job.keys = PrefixCache.keys(prompt, c, len(job.sizes) - 1)  # all whole chunks but the last
        hits = self.prefix.lookup(job.keys, c)
        if not hits:
            return
        pre = self._fresh_row()
        cache = pre.cache
        for i, (kv, _, _) in enumerate(hits):
            cache = plain.put_chunk(cache, kv, jnp.int32(i * c), tcfg)
        job.pre = plain.Prefilled(cache, tuple(aux for _, aux, _ in hits), pre.logits)
        job.done = len(hits)

    def _next_chunk(self, job: _Staged) -> plain.Prefilled:
        """`job`'s buffers after its next chunk (`plain.next_chunk`)."""
        tcfg, dcfg = self.cfgs
        pre = job.pre or self._fresh_row()
        return plain.next_chunk(self.models[0], pre, job.args[0], job.args[1], job.at,
                                job.sizes[job.done], tcfg,
                                () if dcfg is None else dcfg.aux_layer_ids)  # fmt: skip

    def _end_call(self, job: _Staged, pre: plain.Prefilled):
        """(`admit_prefilled`, its arguments) for `job` once its chunks have run."""
        tparams, dparams, embed, _ = self.models
        return admit_prefilled, (tparams, dparams, embed, self.state, jnp.int32(job.slot), *pre,
                                 *job.args, *self._static(job.shape), job.rows)  # fmt: skip

    def prefill_some(self, everything: bool = False) -> int:
        """Runs staged admissions' chunks (`prefill_chunk`), oldest first: at most C tokens
        (at least one chunk) while some row decodes; while none does, until one request joins
        and then at most C more; `everything`: all of them. A staged request whose last chunk
        ran joins the batch (its first token reported by the next `poll`). Returns the prompt
        tokens prefilled."""
        decoding = any(o is not None for o in self.owner)
        budget = math.inf if everything or not decoding else self.prefill_chunk
        spent = 0
        while self.staged:
            job = next(iter(self.staged.values()))
            if spent and spent + job.sizes[job.done] > budget:
                break
            job.pre = self._next_chunk(job)
            spent += job.sizes[job.done]
            if job.done < len(job.keys):  # a whole chunk a later prompt may begin with
                at, c = job.at, self.prefill_chunk
                kv = plain.take_chunk(job.pre.cache, jnp.int32(at), self.cfgs[0], c)
                self.prefix.put(job.keys[: job.done + 1], kv, job.pre.aux[-1])
            job.done += 1
            if job.done == len(job.sizes):
                fn, args = self._end_call(job, job.pre)
                self.state = fn(*args)
                del self.staged[job.slot]
                self.owner[job.slot], self.shown[job.slot] = job.request, 0
                if budget == math.inf and not everything:  # a row decodes now: C more at most
                    budget = spent + self.prefill_chunk
        if spent:  # done before the round starts, so the round's measured time is its own
            jax.block_until_ready((self.state, [j.pre for j in self.staged.values()]))
        return spent

    def check_processing(self, max_tokens: int, logit_bias: dict[int, float] | None = None,
                         min_tokens: int = 0, stop_ids: Iterable[int] = (),
                         ignore_eos: bool = False, penalties: Penalties | None = None
                         ) -> tuple[dict[int, float], int, tuple]:  # fmt: skip
        """A request's logit processing as `RowSampling` keeps it: (bias, min_tokens, the ids
        barred until then: `stop_ids` and EOS unless ignored, none without min_tokens); its
        `penalties` (its sampling's) need the engine's room. Raises Eagle3Error naming the
        problem."""
        vocab = self.cfgs[0].vocab_size
        bias = dict(logit_bias or {})
        room, ban_room, counts = self.shape.row_widths
        penalties = penalties or Penalties()
        if (bias or min_tokens or penalties.on) and not counts:
            raise Eagle3Error("this engine keeps no room for logit processing (processing=False)")
        if len(bias) > room:
            raise Eagle3Error(f"logit_bias has {len(bias)} entries: at most {room} here")
        for i, v in bias.items():
            if not 0 <= i < vocab:
                raise Eagle3Error(f"logit_bias: token id {i} outside 0..{vocab - 1}")
            if not math.isfinite(v):
                raise Eagle3Error(f"logit_bias: {v} for token {i} is not a finite number")
        if not 0 <= min_tokens <= max_tokens:
            raise Eagle3Error(f"min_tokens {min_tokens}: give 0 .. max_tokens ({max_tokens})")
        ban = ()
        if min_tokens:
            ban = tuple(sorted(set(stop_ids) | (set() if ignore_eos else set(self.eos))))
            if len(ban) > ban_room:
                raise Eagle3Error(f"min_tokens bars {len(ban)} stop token ids (EOS included): "
                                  f"at most {ban_room} here")  # fmt: skip
        return bias, min_tokens, ban

    def _admit_args(self, slot: int, prompt: list[int], max_tokens: int, seed: int = 0,
                    sampling: Sampling | None = None, ignore_eos: bool = False,
                    processing: tuple = ({}, 0, ())) -> tuple:  # fmt: skip
        """`admit_row`'s arguments: the prompt padded to its bucket (`_one_prompt`);
        `processing` as `check_processing` gives it."""
        one, toks, lengths = self._one_prompt(prompt)
        bias, min_tokens, ban = processing
        rows = RowSampling.of([self.opts.sampling if sampling is None else sampling], [ignore_eos],
                              [bias], [min_tokens], [ban], self.shape.row_widths)  # fmt: skip
        return (
            *self.models, self.state, jnp.int32(slot), toks, lengths,
            np.array([max_tokens], np.int32), jax.random.PRNGKey(seed), *self._static(one), rows,
        )  # fmt: skip

    def _one_prompt(self, prompt: list[int]) -> tuple[plain.Shape, np.ndarray, np.ndarray]:
        """A batch of one `prompt`: its shape (the prompt padded to its bucket of
        `plain.PROMPT_BUCKET`, the slots' S and buffers), its tokens [1, T] and length [1]."""
        bucket = min(plain.round_up(len(prompt), plain.PROMPT_BUCKET), self.shape.slots)
        one = dataclasses.replace(self.shape, batch=1, prompt_len=bucket)
        return (one, *plain.pad_prompts([prompt], one, self.pad))

    def prompt_buckets(self) -> list[int]:
        """The padded prompt lengths an admission can have, one compiled program each: every
        multiple of `plain.PROMPT_BUCKET` up to the longest prompt `check` lets in (S less the
        room a round reserves and one new token)."""
        longest = self.shape.slots - self.tree.round_slots - 2
        top = min(plain.round_up(longest, plain.PROMPT_BUCKET), self.shape.slots)
        return list(range(plain.PROMPT_BUCKET, top + 1, plain.PROMPT_BUCKET))

    def compile_admissions(self, buckets: list[int] | None = None, threads: int = 0) -> int:
        """Compiles the admission of every prompt bucket (default `prompt_buckets()`) ahead of
        time, so no request waits for a compile between rounds (seconds each on a CPU, holding
        up every running request); `threads` compile at once (default: one per CPU). Nothing
        runs: the state is untouched. Returns how many programs it compiled or found."""
        buckets = self.prompt_buckets() if buckets is None else buckets
        if self.prefill_chunk:
            return _compile_ahead(self._chunked_calls(buckets), threads)
        return _compile_ahead([(admit_row, self._admit_args(0, [self.pad] * n, 1))
                               for n in buckets], threads)  # fmt: skip

    def _chunked_calls(self, buckets: list[int]) -> list[tuple]:
        """A chunked admission's programs for prompts of these buckets: the chunk program of
        each chunk size they take and each bucket's `admit_prefilled`."""
        tcfg, dcfg = self.cfgs
        aux_ids = () if dcfg is None else dcfg.aux_layer_ids
        pre = self._fresh_row()
        length = jnp.ones((1,), jnp.int32)
        chunk, calls = {}, []
        for size in sorted({c for n in buckets for c in plain.chunk_sizes(n, self.prefill_chunk)}):
            args = (self.models[0], pre.cache, pre.logits, jnp.zeros((1, size), jnp.int32),
                    jnp.int32(0), length, tcfg, aux_ids)  # fmt: skip
            chunk[size] = jax.eval_shape(plain.prefill_chunk, *args)[1]  # its aux part
            calls.append((plain.prefill_chunk, args))
        for n in buckets:
            job = self._stage(None, 0, self._admit_args(0, [self.pad] * n, 1))
            aux = tuple(chunk[c] for c in plain.chunk_sizes(n, self.prefill_chunk))
            calls.append(self._end_call(job, plain.Prefilled(pre.cache, aux, pre.logits)))
        if self.prefix is not None:  # a chunk kept and one restored
            at = jnp.int32(0)
            kv = jax.eval_shape(plain.take_chunk, pre.cache, at, tcfg, self.prefill_chunk)
            calls += [(plain.take_chunk, (pre.cache, at, tcfg, self.prefill_chunk)),
                      (plain.put_chunk, (pre.cache, kv, at, tcfg))]  # fmt: skip
        return calls

    def _score_args(self, prompt: list[int]) -> tuple:
        """`score_prompt`'s arguments: the prompt padded as an admission pads it."""
        return (self.models[0], self._one_prompt(prompt)[1], self.cfgs[0], self.shape.logprobs)

    def score(self, prompt: list[int]) -> list[tuple[float, list[tuple[int, float]]]]:
        """The prompt's tokens after the first, each (its log-probability under the target
        given those before it, the `max_logprobs` most likely tokens there as (id,
        log-probability)): what `echo` with logprobs reports. Needs max_logprobs; one compile
        per prompt bucket (`compile_scoring`)."""
        if self.shape.logprobs is None:
            raise Eagle3Error("scoring a prompt needs max_logprobs (serve --max-logprobs N)")
        self.check(prompt, 1)
        lp = jax.device_get(score_prompt(*self._score_args(prompt)))
        return [(float(lp.logprob[t]), [(int(i), float(x)) for i, x in zip(lp.top_ids[t], lp.top[t])])
                for t in range(len(prompt) - 1)]  # fmt: skip

    def compile_scoring(self, buckets: list[int] | None = None, threads: int = 0) -> int:
        """Compiles `score` for every prompt bucket ahead of time, as `compile_admissions` does
        the admissions (none without max_logprobs); returns how many programs."""
        if self.shape.logprobs is None:
            return 0
        buckets = self.prompt_buckets() if buckets is None else buckets
        return _compile_ahead([(score_prompt, self._score_args([self.pad] * n)) for n in buckets],
                              threads)  # fmt: skip

    def release(self, slot: int) -> None:
        """Frees `slot` now (its request is dropped: a disconnect, a stop string); its row rides
        along frozen until another request is admitted there."""
        if self.staged.pop(slot, None) is not None:  # its chunks so far are dropped
            return
        if self.owner[slot] is None:
            return
        self.state = _free_row(self.state, jnp.int32(slot))
        self.owner[slot] = None

    def state_lost(self) -> bool:
        """Whether a failed call consumed the state (an admission and a round donate it)."""
        return any(x.is_deleted() for x in jax.tree.leaves(self.state))

    def reset(self) -> None:
        """Every slot freed and the state rebuilt empty, its shapes and layout as before (so
        every compiled program still serves): after a round or an admission failed, when the
        state it was given may be gone."""
        for x in jax.tree.leaves(self.state):  # the old state's memory first
            if not x.is_deleted():
                x.delete()
        self.state = self._empty()
        self.owner = [None] * self.slots
        self.shown = [0] * self.slots
        self.staged = {}
        self.current_tree = None

    def step(self, tree: TreeConfig | None = None) -> list[Update]:
        """One speculative round over the busy slots (`round_rows`; none when no slot is
        running), then each occupied slot's new tokens; a slot whose request ended is freed. The round's tree is
        the schedule's for the busy slots (a `MeasuredSchedule` is told how the round went), or
        `tree` if given (one of the schedule's: compiling them before serving). Staged
        admissions first run a chunk (`prefill_some`)."""
        self.prefill_some()
        running = [i for i, o in enumerate(self.owner) if o is not None]
        if not running:
            return []
        finish, before = jax.device_get((self.state.finish, self.state.num_new))
        if not any(finish[i] == 0 for i in running):
            return self.poll()
        measured = tree is None and isinstance(self.schedule, MeasuredSchedule)
        if tree is None:
            tree = self.schedule.tree_for(len(running))
        if tree != self.current_tree and not measured:
            log.info("occupancy %d: tree %s (%d tokens)", len(running), tree_name(tree),
                     tree.total_tokens)  # fmt: skip
        self.current_tree = tree
        start = time.perf_counter()
        fn, args = self._round_call(tree, self.round_rows(running))
        self.state = fn(*args)
        self.rounds += 1
        self.tree_rounds[tree_name(tree)] += 1
        updates = self.poll()  # waits for the round
        if measured:  # the round's own tokens (not a new row's prefill token)
            tokens = sum(u.num_tokens - int(before[u.slot]) for u in updates)
            capped = any(u.finish_reason in ("max_tokens", "context") for u in updates)
            self.schedule.observe(len(running), tree, tokens, time.perf_counter() - start,
                                  capped)  # fmt: skip
        return updates

    def poll(self) -> list[Update]:
        """Each occupied slot's tokens since the last report (admitted slots: the prefill's)."""
        st = self.state
        tokens, n, finish, fw, lp, settings = jax.device_get(
            (st.tokens, st.num_new, st.finish, st.forwards, st.logprobs,
             {f: getattr(st.sampling, f) for f in QUIET})  # [B] each, not the [B, V] counts
        )  # fmt: skip
        out = []
        for i, req in enumerate(self.owner):
            if req is None:
                continue
            new = [int(t) for t in tokens[i, self.shown[i] : n[i]]]
            reason = plain.FINISH_REASONS[finish[i]] if finish[i] else None
            logprobs = None
            if lp is not None:
                at = range(self.shown[i], int(n[i]))
                logprobs = [(float(lp.logprob[i, j]),
                             [(int(t), float(x)) for t, x in zip(lp.top_ids[i, j], lp.top[i, j])])
                            for j in at]  # fmt: skip
            out.append(Update(i, req, new, reason, int(n[i]), int(fw[i]), logprobs))
            self.shown[i] = int(n[i])
            if reason is not None:
                self.owner[i] = None
                if any(settings[f][i] != v for f, v in QUIET.items()):
                    self.state = _greedy_row(self.state, jnp.int32(i))
        return out

    def compiles(self) -> dict[str, int]:
        """Compiled programs so far in this process: the admission's (one per prompt bucket) and
        the round's (one per tree and row bucket: `speculative.round_step`, shared with
        streaming decoding, for all B rows, `speculative.rows_round` for fewer)."""
        return {"admit": admit_row._cache_size(),
                "round": spec.round_step._cache_size() + spec.rows_round._cache_size()}  # fmt: skip
