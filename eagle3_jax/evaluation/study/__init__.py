"""The draft-vocabulary study's report: every head against EAGLE-3 on the same questions, per tree.

Input: one harness results.json per tree shape (the same questions for every head; the runs of
the study's groups joined by `merge_groups`), the heads' drafting times (benchmarks/draft_cost.py;
several runs put on one scale by `calibrated_costs`) and their held-out training curves. Output: a table
shaped like the SpecVocab paper's (tau per Spec-Bench task, throughput, speedup) with the paper's
figures beside it, per-question paired differences against the reference head with 95 %
intervals, drafting time per step and per round, and plots. Speed without the draft's cost is not
the paper's measure, so every row carries both.

The package, one concern a module: heads (the heads and the runs merged into one tree's results),
costs (drafting times), tables (one tree's rows and tables), curves (held-out training curves),
accelerator (the paper's setting predicted and timed), text (how numbers are written), document
(the report and its summary) and plots. Every public name is re-exported here.
"""

from eagle3_jax.evaluation.study.accelerator import (
    accelerator_section,
    measured_section,
    paper_specvocab_over_eagle3,
)
from eagle3_jax.evaluation.study.costs import calibrated_costs, cost_section, round_draft_ms
from eagle3_jax.evaluation.study.curves import curve_points, curve_section, read_curve
from eagle3_jax.evaluation.study.document import report
from eagle3_jax.evaluation.study.heads import (
    FAMILIES,
    PAPER,
    StudyHead,
    group_names,
    head_of_cell,
    label_of,
    merge_groups,
    tree_of,
)
from eagle3_jax.evaluation.study.plots import plot
from eagle3_jax.evaluation.study.tables import head_rows, tree_section
from eagle3_jax.evaluation.study.text import fmt, paired_n, paired_speed, paired_text, vocab_text

__all__ = [
    "accelerator_section",
    "measured_section",
    "paper_specvocab_over_eagle3",
    "calibrated_costs",
    "cost_section",
    "round_draft_ms",
    "curve_points",
    "curve_section",
    "read_curve",
    "report",
    "FAMILIES",
    "PAPER",
    "StudyHead",
    "group_names",
    "head_of_cell",
    "label_of",
    "merge_groups",
    "tree_of",
    "plot",
    "head_rows",
    "tree_section",
    "fmt",
    "paired_n",
    "paired_speed",
    "paired_text",
    "vocab_text",
]
