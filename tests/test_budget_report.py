"""evaluation/budget_report.py: a grid's heads measured at several training budgets, each paired
with the reference's head of the same budget; which differences are real and from which budget;
the held-out curves against tokens in one two-panel figure (synthetic records and curves)."""

from __future__ import annotations

import json

from eagle3_jax.evaluation import budget_report as br

STEPS = (100, 200)
CELLS = {"lmh": "layers 2/15/27", "top": "layers 30", "ttt_3": "TTT steps 3"}


def _results(n=8, task=lambda i: "qa" if i % 2 else "math"):
    """One merged run: every (cell, step) head replayed. top is as good as lmh at step 100 and
    one forward a turn worse at step 200 (a real difference from 200 on); ttt_3 is lmh give or
    take a round at both (never real)."""
    methods = [{"label": "vanilla", "kind": "vanilla", "tree": [1, 1, 1], "draft": None}]
    recs = []
    for cell in CELLS:
        for s in STEPS:
            d = br.head_name(cell, s)
            methods.append({"label": f"eagle3@{d}", "kind": "eagle3", "tree": [10, 8, 60],
                            "draft": d})  # fmt: skip
    for i in range(n):
        base = {"question_id": i, "task": task(i), "seed": 0, "num_generations": 1,
                "new_tokens": 60}  # fmt: skip
        recs.append({**base, "method": "vanilla", "target_forwards": 61, "wall_time_s": 1.0})
        for s in STEPS:
            fw = {"lmh": 21, "top": 20 + (i + 1) % 3 if s == 100 else 31 + i % 3,
                  "ttt_3": 20 + i % 3}  # fmt: skip
            for cell, f in fw.items():
                recs.append({**base, "method": f"eagle3@{br.head_name(cell, s)}",
                             "target_forwards": f, "wall_time_s": 0.0, "replayed": True})  # fmt: skip
    return {"config": {"methods": methods, "max_new_tokens": 60}, "records": recs}


CURVES = {
    c: [{"step": s, "tokens": 1000 * s, "acc_0": a + s / 1000, "chain_tau": 1.5 + s / 400}
        for s in (50, 100, 150, 200)]
    for c, a in (("lmh", 0.3), ("top", 0.25), ("ttt_3", 0.31))
}  # fmt: skip


def test_each_budget_pairs_with_the_reference_at_that_budget():
    rows = {r["cell"]: r for r in br.budget_rows(_results(), CELLS, "lmh", 200)}
    assert list(rows) == ["lmh", "top", "ttt_3"] and "vs_reference" not in rows["lmh"]
    assert rows["top"]["vs_reference"]["real"] and rows["top"]["vs_reference"]["mean"] < -0.5
    assert not rows["ttt_3"]["vs_reference"]["real"]
    early = {r["cell"]: r for r in br.budget_rows(_results(), CELLS, "lmh", 100)}
    assert not early["top"]["vs_reference"]["real"]


def test_report_names_the_budget_a_difference_first_appears_at():
    runs = {"mt_bench": _results(), "spec_bench": _results(12, lambda i: ("qa", "rag")[i % 2])}
    text, summary = br.report(runs, CELLS, "lmh", list(STEPS), CURVES, title="Fusion, trained")
    assert text.startswith("# Fusion, trained") and "## mt_bench (8 questions)" in text
    assert "## spec_bench (12 questions)" in text
    assert "| cell | what differs | step 100 (100,000 tokens) | step 200 (200,000 tokens) |" in text
    assert "| top | layers 30 |" in text and "| step 200 | yes |" in text
    assert "Real differences from `lmh` at 95 %: top (from step 200)." in text
    assert summary["first_real"]["mt_bench"] == {"lmh": None, "top": 200, "ttt_3": None}
    assert summary["tokens"] == {"100": 100000, "200": 200000}
    assert "| cell | qa | rag |" in text  # Spec-Bench's tasks at the last budget
    assert "| 150 | 150,000 |" in text  # the held-out curves, every validation
    json.dumps(summary)


def test_a_budget_not_measured_yet_is_left_out():
    res = _results()
    res["records"] = [r for r in res["records"] if not r["method"].endswith("_step200")]
    res["config"]["methods"] = [
        m for m in res["config"]["methods"] if not (m["draft"] or "").endswith("_step200")
    ]
    text, summary = br.report({"mt_bench": res}, CELLS, "lmh", list(STEPS), {})
    assert list(summary["benches"]["mt_bench"]) == ["100"] and "step 200" not in text
    assert "No difference from `lmh` is real at 95 % at any budget measured." in text


def test_tau_vs_tokens_plot_has_both_panels(tmp_path):
    path = br.plot_tau_vs_tokens(CURVES, tmp_path)
    assert path.name == "tau_vs_tokens.png" and path.stat().st_size > 5000
    assert br.plot_tau_vs_tokens({"lmh": [{"step": 10, "acc_0": 0.1, "chain_tau": 1.1}]},
                                 tmp_path).exists()  # fmt: skip


def test_budgets_are_exported_steps_and_the_schedule_is_checked():
    import pytest

    from eagle3_jax.ablation.config import AblationConfig, Cell
    from eagle3_jax.errors import Eagle3Error
    from eagle3_jax.training.config import TrainConfig

    base = TrainConfig().replace(max_steps=300, export_every=100, schedule="constant")
    ok = AblationConfig(base=base, cells=(Cell("a"),), budgets=(100, 300))
    assert ok.validate().measured() == (("mt_bench", 2),)
    for bad in ((150,), (200, 100), (400,)):
        with pytest.raises(Eagle3Error, match="budget"):
            AblationConfig(base=base, cells=(Cell("a"),), budgets=bad).validate()
    with pytest.raises(Eagle3Error, match="schedule"):
        TrainConfig().replace(schedule="linear").validate()


def test_a_constant_schedule_holds_the_peak_rate_after_warmup():
    """The step size of plain SGD-like updates: AdamW's first update is lr * sign(g), so the
    update at step t measures the schedule there."""
    import jax.numpy as jnp
    import numpy as np

    from eagle3_jax.training.config import TrainConfig
    from eagle3_jax.training.step import make_optimizer

    def sizes(schedule):
        oc = TrainConfig().replace(lr=1e-2, warmup_ratio=0.1, schedule=schedule).optim
        tx = make_optimizer(oc, 100)
        p = {"w": jnp.zeros(())}
        st = tx.init(p)
        out = []
        for _ in range(100):
            u, st = tx.update({"w": jnp.ones(())}, st, p)
            out.append(float(-u["w"]))
        return np.array(out)

    const, cos = sizes("constant"), sizes("cosine")
    np.testing.assert_allclose(const[20:], 1e-2, rtol=1e-4)
    assert cos[-1] < 1e-3 and const[5] < 1e-2
