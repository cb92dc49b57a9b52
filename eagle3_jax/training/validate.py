"""How well a head drafts text it was not trained on, from its TTT metrics alone.

  python -m eagle3_jax validate --draft HEAD --data [NAME=]FILE [--data ...] \
      [--target PATH] [--max-len 512] [--sample N] [--batch-size 4] [--json OUT]

Each data file (ShareGPT / role-content conversations, as training reads them) is tokenised with
the target's chat template and run through the training step's loss without an update: the
target's features, then the head unrolled for `--ttt-steps` steps on its own hidden states. For
every set it reports, per TTT step i:

* acc_i: the share of supervised positions where step i drafts the target's greedy token (the
  training log's acc_i);
* chain_i: the share of positions where steps 0..i ALL draft the target's token. A step's inputs
  are the true tokens, which a decoded chain sees exactly while its drafts were right, and the
  TTT attention is the decoding one, so chain_i is the share of positions from which a greedy
  chain of depth > i would accept i+1 tokens, and 1 + sum(chain[:d]) estimates a depth-d
  chain's tau on that text (as if a round started at every position, where decoding starts
  one after each bonus token);
* xent_i: the cross-entropy against the target's distribution per supervised position;
* replay_tau (depth 1..steps): greedy chain decoding replayed over each answer from the
  per-position streaks, round by round as decoding roots them (the prefill gives an answer's first
  token; each round accepts the streak at its root, at most the depth, plus the bonus). On an
  answer the target wrote greedily this is the tau a chain decodes it with, without decoding.

Comparing sets separates what training data cannot tell apart: a head's own training text
against held-out text of the same kind (how much it has memorised) against the evaluation's
text (how far that kind is from what it is measured on), and, against the tau that decoding
measures on the same text, whether decoding drafts as training scored.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.data.conversations import read_conversations
from eagle3_jax.data.dataset import Batch, batch_arrays, bucket_length, build_dataset
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation.questions import BENCHES, load_questions
from eagle3_jax.evaluation.records import read_results
from eagle3_jax.training.config import TrainConfig
from eagle3_jax.training.step import loss_fn


def chain_tau(chain, depth: int) -> float:
    """Estimated tau of a depth-`depth` chain from the chain_i shares (see the module docstring)."""
    chain = np.asarray(chain, np.float64)
    if not 1 <= depth <= chain.size:
        raise Eagle3Error(f"depth {depth} outside 1..{chain.size} (the TTT steps scored)")
    return 1.0 + float(chain[:depth].sum())


@dataclasses.dataclass
class Scores:
    records: int  # conversations scored
    skipped: int  # conversations left out: no answer token within max_len, or unrenderable
    tokens: int  # tokens read (prompts and answers, no padding)
    supervised: int  # positions supervised at step 0 (answer tokens with a next token)
    acc: list[float]
    chain: list[float]
    xent: list[float]
    # tau of greedy chain decoding of depth 1..steps over these answers, replayed from the
    # per-position streaks (replay_chain): decoding's own rounds, where chain_tau counts a chain
    # from every position
    replay_tau: list[float] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["chain_tau"] = [chain_tau(self.chain, k) for k in range(1, len(self.chain) + 1)]
        return d


def answer_spans(loss_mask_T) -> list[tuple[int, int]]:
    """[start, end) of each run of supervised tokens (an answer) that has a prompt before it."""
    m = np.asarray(loss_mask_T).astype(np.int8)
    edges = np.diff(np.concatenate([[0], m, [0]]))
    spans = zip(np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0])
    return [(int(a), int(b)) for a, b in spans if a > 0]


def replay_chain(streak_T, loss_mask_T, depth: int) -> tuple[int, int]:
    """(tokens, rounds) of greedy depth-`depth` chain decoding over one row's answers, replayed
    from the per-position streaks (ttt_loss per_position): the prefill emits an answer's first
    token; a round rooted at position r drafts from the feature at r - 1, accepts
    min(streak[r - 1], depth) tokens (no more than the answer holds) and adds the bonus. Counted
    as τ is (`evaluation.metrics.tau_of`): the prefill's token and pass left out."""
    tokens = rounds = 0
    for a, b in answer_spans(loss_mask_T):
        tokens += b - a - 1
        r = a
        while r < b - 1:
            r += min(int(streak_T[r - 1]), depth, b - 1 - r) + 1
            rounds += 1
    return tokens, rounds


@functools.cache
def _jitted_loss(tcfg, dcfg, tc):
    """One jitted loss per configuration: validating every N steps compiles once per shape."""

    return jax.jit(functools.partial(loss_fn, tcfg=tcfg, dcfg=dcfg, tc=tc, per_position=True))


def score_batches(loss, dparams, tparams, arrays_iter, t2d, steps: int) -> dict[str, np.ndarray]:
    """Sums the raw TTT counts over batches (exact averages whatever the batch shapes), and the
    tokens and rounds of chain decoding replayed at every depth 1..steps."""
    tot: dict[str, np.ndarray] = {}
    for arrays in arrays_iter:
        _, m = loss(dparams, tparams, arrays, t2d)
        m = jax.device_get(m)
        replay = np.zeros((2, steps))
        for streak, mask in zip(np.asarray(m["streak"]), arrays["loss_mask"]):
            for d in range(1, steps + 1):
                replay[:, d - 1] += replay_chain(streak, mask, d)
        part = {
            "replay_tokens": replay[0],
            "replay_rounds": replay[1],
            "correct": m["correct"],
            "denom": m["denom"],
            "chain_correct": m["chain_correct"],
            "pcount": m["pcount"],
            # ploss is scaled by B * mean_len (loss_fn passes max_len as mean_len)
            "xent_sum": m["xent"] * m["pcount"],
        }
        for k, v in part.items():
            tot[k] = tot.get(k, 0) + np.asarray(v, np.float64)
    return tot


def score_head(
    target,
    dparams,
    dcfg,
    vocab,
    ds,
    *,
    steps: int = 7,
    batch_size: int = 4,
    length_bucket: int = 64,
    compute_dtype: str = "float32",
    progress: bool = True,
) -> Scores:
    """TTT metrics of a head on a tokenised dataset (every record once, shortest first)."""
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise Eagle3Error(f"batch size {batch_size} < 1")
    if steps < 1:
        raise Eagle3Error(f"ttt steps {steps} < 1")
    tc = TrainConfig().replace(ttt_steps=steps, max_len=ds.max_len, compute_dtype=compute_dtype)
    loss = _jitted_loss(target.cfg, dcfg, tc)
    order = np.argsort(ds.lengths, kind="stable")  # similar lengths together: little padding

    def arrays_iter():
        bar = tqdm(total=len(order), desc="scoring", unit="conv", disable=not progress)
        for lo in range(0, len(order), batch_size):
            rows = order[lo : lo + batch_size]
            t = bucket_length(ds.lengths[rows].max(), length_bucket, ds.max_len)
            ids = np.full((batch_size, t), ds.pad_id, np.int32)  # one batch shape per length
            mask = np.zeros((batch_size, t), np.int8)
            lengths = np.zeros((batch_size,), np.int32)  # rows past the data: all padding
            ids[: rows.size] = ds.input_ids[rows, :t]
            mask[: rows.size] = ds.loss_mask[rows, :t]
            lengths[: rows.size] = ds.lengths[rows]
            yield batch_arrays(Batch(0, 0, ids, mask, lengths, rows))
            bar.update(rows.size)
        bar.close()

    tot = score_batches(loss, dparams, target.params, arrays_iter(), jnp.asarray(vocab.t2d), steps)
    denom = tot["denom"]
    return Scores(
        records=int(ds.num_records),
        skipped=int(ds.skipped),
        tokens=int(ds.lengths.sum()),
        supervised=int(denom[0]),
        acc=(tot["correct"] / np.maximum(denom, 1)).tolist(),
        chain=(tot["chain_correct"] / max(denom[0], 1)).tolist(),
        xent=(tot["xent_sum"] / np.maximum(tot["pcount"], 1)).tolist(),
        replay_tau=(tot["replay_tokens"] / np.maximum(tot["replay_rounds"], 1)).tolist(),
    )


def conversations_from_eval(path: str | Path, tokenizer, method: str = "vanilla") -> list:
    """The conversations an evaluation run decoded (`eagle3_jax.eval`'s results.json, or .gz): every
    question's user turns with `method`'s answers (greedy exact methods all give the target's),
    each answer as the next turn saw it (its text, special tokens dropped)."""

    res = read_results(path)
    bench = res["config"]["bench"]
    # a question file that is gone (a subset written for one run): the shipped benchmarks' ids
    names = [bench] if bench in BENCHES or Path(bench).is_file() else list(BENCHES)
    questions = {}
    for name in names:  # an id two benchmarks share: the first one's (Spec-Bench's)
        for q in load_questions(name):
            questions.setdefault(q.id, q)
    convs = []
    for rec in res["records"]:
        if rec["method"] != method or str(rec.get("seed", "0")) != "0":
            continue
        q = questions.get(str(rec["question_id"]))
        if q is None:
            raise Eagle3Error(f"{path}: question {rec['question_id']} is not in the benchmark")
        msgs = []
        for text, ids in zip(q.turns, rec["output_ids"]):
            msgs += [
                {"role": "user", "content": text},
                {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)},
            ]
        convs.append(msgs)
    if not convs:
        raise Eagle3Error(f"{path} holds no records of method {method!r}")
    return convs


def sample(items: list, n: int, seed) -> list:
    """`n` of the items drawn at random (seeded), in their order; all of them when n is 0 or more
    than there are."""
    if not n or n >= len(items):
        return items
    pick = np.random.default_rng(seed).choice(len(items), n, replace=False)
    return [items[i] for i in sorted(pick)]


def split_set(spec: str) -> tuple[str, str]:
    """'NAME=FILE' or 'FILE' -> (name, path), the file checked (before any model is loaded)."""
    name, _, path = spec.rpartition("=")
    for part in path.split(","):
        if not Path(part).is_file():
            raise Eagle3Error(f"data file {part} does not exist")
    return name or Path(path.split(",")[0]).name.split(".")[0], path


def load_set(spec: str, tokenizer, max_len: int, n: int, seed: int):
    """'NAME=FILE' or 'FILE' -> (name, tokenised dataset); `n` > 0 keeps that many
    conversations drawn at random (seeded), else all. FILE is training data (ShareGPT /
    role-content conversations) or an evaluation's results.json[.gz] (its questions and answers)."""

    name, path = split_set(spec)
    if path.endswith(("results.json", "results.json.gz")):
        convs = conversations_from_eval(path, tokenizer)
    else:
        convs, _ = read_conversations(path)
    return name, build_dataset(tokenizer, sample(convs, n, seed), max_len, progress=False)
