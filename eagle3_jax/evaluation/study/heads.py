"""The study's heads (which method family each stands for) and its harness runs: which label ran
a head, the one tree shape of a run, and one tree's results merged from its groups' runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation import metrics

# The SpecVocab paper and README (H100, Spec-Bench, greedy, batch 1), as
# ../shared/reference/draft-vocab-methods.md quotes them: tau on OLMo 2 1B, tokens/s on OLMo 2 7B.
PAPER = {
    "eagle3": {"tau_olmo2_1b": 4.31, "tps_olmo2_7b": 189.3},
    "frspec": {"tps_olmo2_7b": 190.9},
    "vocabtrim": {"tps_olmo2_7b": 194.2},
    "specvocab": {"tau_olmo2_1b": 4.53, "tps_olmo2_7b": 204.7},
}


FAMILIES = ("eagle3", "frspec", "vocabtrim", "specvocab", "full", "target_lm_head")


@dataclasses.dataclass(frozen=True)
class StudyHead:
    """One head of the study: its harness draft name, the method family it stands for (one of
    FAMILIES), its draft vocabulary size (None: the target's whole vocabulary, `target_vocab`
    ids where known) and how it was made."""

    name: str
    family: str
    vocab: int | None
    note: str = ""
    target_vocab: int | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"head {self.name}: family {self.family!r} not in {FAMILIES}")


def head_of_cell(name: str, overrides: dict, vocab_size: int) -> StudyHead:
    """The study head a training cell stands for, from the overrides that define it: a
    speculator is SpecVocab, the target's output embedding is FR-Spec's source, a reduced own
    lm_head is EAGLE-3, a full own lm_head is VocabTrim's source."""
    vd = overrides.get("draft_vocab_size", vocab_size)
    if overrides.get("speculator_rank"):
        aux = overrides.get("speculator_loss_weight")
        note = "no auxiliary loss" if aux == 0 else ""
        return StudyHead(name, "specvocab", None, note, vocab_size)
    if overrides.get("lm_head_source") == "target":
        return StudyHead(name, "target_lm_head", None, "FR-Spec's source, untrimmed", vocab_size)
    if vd < vocab_size:
        return StudyHead(name, "eagle3", vd, "", vocab_size)
    return StudyHead(name, "full", None, "VocabTrim's source, untrimmed", vocab_size)


def label_of(results: dict, head: str) -> str | None:
    """The harness's method label that ran draft `head` in this run (None if it did not)."""
    for m in results["config"]["methods"]:
        if m.get("draft") == head:
            return m["label"]
    return None


def tree_of(results: dict) -> tuple:
    """The one speculative tree shape of a run (every eagle3 method shares it)."""
    shapes = {tuple(m["tree"]) for m in results["config"]["methods"] if m["kind"] == "eagle3"}
    if len(shapes) != 1:
        raise ValueError(f"a study run has one tree shape, this one has {sorted(shapes)}")
    return shapes.pop()


def group_names(parts: Sequence, names: Sequence[str] | None) -> list[str]:
    """What a refusal calls each group run: its name, else "#i" for its index."""
    return list(names) if names is not None else [f"#{i}" for i in range(len(parts))]


def merge_groups(parts: Sequence[dict], names: Sequence[str] | None = None) -> dict:
    """One tree's results from its groups' harness runs (benchmarks/vocab_study.py runs each
    cell, with the heads cut from it, as its own run beside its own plain decoding, so that a
    finished group outlives the machine and the heads that made it): every group's heads, the
    first group's plain decoding as `vanilla`, and under `baselines` each head's own group's
    plain decoding, over which its speedup and its paired throughput are taken. The runs must
    agree on all but their heads (the same target files, questions, budget and batch); runs
    that do not are refused (Eagle3Error) naming the group (`names`: each part's, else its
    index)."""
    if not parts:
        raise ValueError("no group results to merge")
    names = group_names(parts, names)
    # target_digest holds the target files' times, which a fresh machine's conversion changes:
    # the groups' stamps (benchmarks/vocab_study.py) hold the target's identity instead
    mine = ("target", "target_digest", "drafts", "methods", "draft_digests", "draft_vocab")
    common = [{k: v for k, v in p["config"].items() if k not in mine} for p in parts]
    for name, c in zip(names[1:], common[1:]):
        if c != common[0]:
            diff = sorted(k for k in set(c) | set(common[0]) if c.get(k) != common[0].get(k))
            raise Eagle3Error(
                f"group {name}'s run differs from group {names[0]}'s in {', '.join(diff)}: "
                "they cannot be merged (remeasure one, or move it away)"
            )
    config = {**parts[0]["config"], "methods": [], "drafts": {}, "draft_digests": {}}
    records, baselines, asked = [], {}, None
    for i, p in enumerate(parts):
        vanilla = [r for r in p["records"] if r["method"] == metrics.VANILLA]
        # every head paired on the questions of every other: each group's plain decoding and
        # heads answered the same ones (a run cut short, or from another question set, is not)
        by_method = {}
        for r in p["records"]:
            by_method.setdefault(r["method"], set()).add(str(r["question_id"]))
        mine = by_method.get(metrics.VANILLA, set())
        asked = mine if asked is None else asked
        odd = {m: q for m, q in by_method.items() if q != asked}
        if odd:
            m, q = next(iter(odd.items()))
            raise Eagle3Error(
                f"group {names[i]} ({m}) answered {len(q)} questions, not the {len(asked)} of "
                f"group {names[0]}'s plain decoding ({len(q ^ asked)} differ): they cannot be "
                "merged (remeasure one, or move it away)"
            )
        labels = {}  # a run of one head labels it without its name: named here, as in a run of many
        for m in p["config"]["methods"]:
            if m["kind"] == "vanilla":
                if i == 0:
                    config["methods"].insert(0, m)
                continue
            draft = m.get("draft")
            label = m["label"] if not draft or "@" in m["label"] else f"{m['label']}@{draft}"
            if label in baselines:
                raise Eagle3Error(f"method {label} is in two group runs (group {names[i]})")
            labels[m["label"]] = label
            config["methods"].append({**m, "label": label})
            baselines[label] = vanilla
        config["drafts"].update(p["config"].get("drafts") or {})
        config["draft_digests"].update(p["config"].get("draft_digests") or {})
        records += vanilla if i == 0 else []
        records += [
            {**r, "method": labels[r["method"]]} for r in p["records"] if r["method"] in labels
        ]
    return {"config": config, "records": records, "baselines": baselines, "runs": len(parts)}
