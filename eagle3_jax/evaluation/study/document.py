"""The study's report.md text and its JSON summary, section by section."""

from __future__ import annotations

from collections.abc import Sequence

from eagle3_jax.evaluation.study.accelerator import accelerator_section, measured_section
from eagle3_jax.evaluation.study.costs import cost_section
from eagle3_jax.evaluation.study.curves import curve_section
from eagle3_jax.evaluation.study.heads import StudyHead, tree_of
from eagle3_jax.evaluation.study.tables import head_rows, tree_section
from eagle3_jax.evaluation.study.text import paired_speed


def report(
    runs: dict[str, dict],
    heads: Sequence[StudyHead],
    reference: str,
    costs: dict[str, dict[str, dict]],
    curves: dict[str, list[dict]] | None = None,
    measured: Sequence[dict] = (),
) -> tuple[str, dict]:
    """The study's report.md text and its JSON summary, from one harness results.json per tree
    (`runs`: tree name -> results), the heads' drafting times at each tree's top-k (`costs`: tree
    name -> head -> benchmarks/draft_cost.py row), held-out curves (`curves`: head ->
    `read_curve`) and the heads' rounds timed on an accelerator (`measured`: round-cost
    results.json files, `measured_section`)."""
    summary = {"reference": reference, "trees": {}}
    lines = [
        "# The draft-vocabulary study",
        "",
        f"Every head against `{reference}` (EAGLE-3's reduced vocabulary) on the same questions.",
        "",
    ]
    for name, results in runs.items():
        rows = head_rows(results, heads, reference, costs.get(name, {}))
        summary["trees"][name] = {
            "tree": list(tree_of(results)),
            "paired_speed": paired_speed(results),
            "rows": rows,
        }
        lines += tree_section(name, results, rows, reference)
    for name, tree_costs in costs.items():
        lines += cost_section(name, tree_costs, heads)
    if curves:
        lines += curve_section(curves)
        summary["curves"] = {k: v[-1] for k, v in curves.items() if v}
    section, summary["accelerator_prediction"] = accelerator_section()
    lines += section
    section, timed = measured_section(measured)
    if section:
        lines += section
        summary["accelerator_measured"] = timed
    return "\n".join(lines), summary
