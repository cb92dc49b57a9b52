"""One method over one batch of questions: the loaded target and drafts (`Models`), each turn
generated (or replayed over vanilla's answers) for every question still in the conversation, and
the records that makes, one per question."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from eagle3_jax import backends, cpu_tuning
from eagle3_jax.checkpoints import load_target
from eagle3_jax.checkpoints.heads import load_head
from eagle3_jax.compile_cache import release_if_crowded
from eagle3_jax.config import default_dtype
from eagle3_jax.decoding.generate import DecodeOptions, Generation, generate_ids
from eagle3_jax.decoding.replay import replay_ids
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation import metrics
from eagle3_jax.evaluation.options import EvalOptions, MethodSpec
from eagle3_jax.evaluation.questions import Question
from eagle3_jax.prompts import encode_chat
from eagle3_jax.sharding import make_mesh, parse_mesh


def process_mesh(text: str | None):
    """`--mesh DATAxMODEL` over this process's own devices: with several processes each runs
    its own batches, so its mesh spans only its devices; with one, `parse_mesh`."""
    mesh = parse_mesh(text)
    if mesh is None or jax.process_count() == 1:
        return mesh
    data, model = mesh.shape["data"], mesh.shape["model"]
    local = jax.local_devices()
    if data * model > len(local):
        raise Eagle3Error(
            f"--mesh {text}: each of the {jax.process_count()} processes runs its own questions "
            f"on its own {len(local)} devices; give DATAxMODEL within them"
        )
    return make_mesh(data, model, local)


class Models:
    """The loaded target and drafts ({name: (params, cfg, vocab, embed)}), and one generation call
    per method."""

    def __init__(self, target, drafts: dict[str, tuple]):
        self.target, self.drafts = target, drafts

    @classmethod
    def load(cls, opts: EvalOptions, drafts: dict[str, str], vocab_requests=None) -> Models:
        """The target of opts and each {name: path} head, checked against it (and cut as
        {name: --draft-vocab request} says; "auto" when not named)."""

        dtype = default_dtype(opts.dtype)
        mesh = process_mesh(opts.mesh)
        target = load_target(opts.target, dtype=dtype, mesh=mesh)
        # this machine's few-row products (measured once per CPU), for the target and its heads;
        # on accelerators, fused projections (backends.py)
        target = backends.prepare_target(target, cpu_tuning.policy_for(), mesh=mesh)
        req = vocab_requests or {}
        return cls(
            target,
            {n: load_head(p, target, dtype, req.get(n, "auto"), mesh) for n, p in drafts.items()},
        )

    def generate(self, m: MethodSpec, ids, sampling, seed: int, max_new: int) -> Generation:
        """One batch of token-id prompts with method m (`generate_ids`); each call first runs a
        warm-up generation (compilation), excluded from the time."""

        release_if_crowded()  # many methods x prompt lengths: keep under the kernel's map limit
        opts = DecodeOptions(m.kind, max_new, TreeConfig(*m.tree), sampling, seed)
        head = self.drafts[m.draft] if m.draft else None
        return generate_ids(self.target, head, ids, opts, warmup=True)

    def replay(self, m: MethodSpec, ids, answers, max_new: int) -> Generation:
        """Method m's greedy generation replayed over the target's greedy `answers` (`replay_ids`:
        its τ and acceptance; no timing)."""

        release_if_crowded()
        opts = DecodeOptions(m.kind, max_new, TreeConfig(*m.tree))
        head = self.drafts[m.draft] if m.draft else None
        return replay_ids(self.target, head, ids, answers, opts)


def run_questions(
    models: Models, m: MethodSpec, batch: Sequence[Question], sampling, seed: int, max_new: int,
    answers: Sequence[dict] | None = None,
) -> list[dict]:  # fmt: skip
    """Every turn of a batch of questions with one method; turn t+1 is conditioned on the model's
    own answer to turn t (chat template history). Both turns are timed and counted. `answers`
    (vanilla's records of the batch): the method is replayed over their answers, turn by turn
    (`replay_ids`): its records say `replayed`, decoding's time in them is 0 and the replay's
    own is `replay_time_s`."""

    tok = models.target.tokenizer
    history: list[list[dict[str, str]]] = [[] for _ in batch]
    turns: list[list[dict]] = [[] for _ in batch]
    for t in range(max(len(q.turns) for q in batch)):
        active = [i for i, q in enumerate(batch) if len(q.turns) > t]
        for i in active:
            history[i].append({"role": "user", "content": batch[i].turns[t]})
        ids = [encode_chat(tok, history[i]) for i in active]
        if answers is None:
            res = models.generate(m, ids, sampling, seed, max_new)
        else:
            res = models.replay(m, ids, [answers[i]["output_ids"][t] for i in active], max_new)
        wall = res.wall_time_s
        for i, pids, row in zip(active, ids, res.rows()):
            out, text = row.output_ids, row.text
            history[i].append({"role": "assistant", "content": text})
            turns[i].append(_turn_record(pids, out, text, row, wall, len(active), answers))
    return [_question_record(q, m, seed, ts, answers) for q, ts in zip(batch, turns)]


def _turn_record(pids, out, text, row, wall: float, rows: int, answers) -> dict:
    """One question's turn: its tokens, text and counts, and its row's share of the batch's time
    (`rows` rows); replayed (`answers`), the replay's own time, apart from decoding's."""
    rec = {
        "prompt_tokens": len(pids),
        "output_ids": out,
        "text": text,
        "new_tokens": len(out),
        "target_forwards": row.target_forwards,
        "finish_reason": row.finish_reason,
        "accept_hist": row.accept_hist,
        "verified_tokens": row.verified_tokens,  # tree tokens over its rounds
        "wall_time_s": wall / rows,  # this row's share of the batch
        "batch_wall_time_s": wall,
    }
    if answers is not None:  # not decoding's time: the replay's own, apart
        rec.update(wall_time_s=0.0, batch_wall_time_s=0.0, replay_time_s=wall / rows)
    return rec


def _question_record(q: Question, m: MethodSpec, seed: int, ts: list[dict], answers) -> dict:
    """A question's record: its turns (`ts`) summed, with its τ, throughput and acceptance."""
    hists = [x["accept_hist"] for x in ts if x["accept_hist"] is not None]
    rec = {
        "question_id": q.id,
        "task": q.task,
        "category": q.category,  # MT-bench's subcategory; a task is its own otherwise
        "method": m.label,
        "seed": seed,
        "num_generations": len(ts),
        "new_tokens": sum(x["new_tokens"] for x in ts),
        "target_forwards": sum(x["target_forwards"] for x in ts),
        "wall_time_s": sum(x["wall_time_s"] for x in ts),
        "output_ids": [x["output_ids"] for x in ts],
        "accept_hist": np.sum(hists, axis=0).tolist() if hists else None,
        "verified_tokens": (
            sum(x["verified_tokens"] for x in ts)
            if all(x.get("verified_tokens") is not None for x in ts)
            else None
        ),
        # each turn's counts, text and time; its tokens are the record's output_ids alone (the
        # committed results.json.gz files are a third smaller for it)
        "turns": [{k: v for k, v in x.items() if k != "output_ids"} for x in ts],
    }
    if answers is not None:
        rec["replayed"] = True
        rec["replay_time_s"] = sum(x["replay_time_s"] for x in ts)
    rec["tau"] = metrics.tau([rec])
    rec["tokens_per_s"] = metrics.throughput([rec])
    if hists:
        rec["acceptance_by_depth"] = metrics.acceptance_by_depth([rec])
    return rec
