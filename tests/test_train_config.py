"""Every shipped config loads; overrides are typed; bad configs are refused clearly; records of
the flat layout written before the config's groups still read, and still equal the same config."""

import json
import re
from pathlib import Path

import pytest

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.training.config import FIELDS, GROUPS, TrainConfig, flatten, load_config
from eagle3_jax.training.config_groups import OptimConfig

ROOT = Path(__file__).resolve().parents[1]
ALL = sorted(p for p in (ROOT / "configs").glob("*.py") if "def get_config" in p.read_text())
# ablation grids (python -m eagle3_jax ablate, or a study script that runs one) build an
# AblationConfig, themselves or through configs/vocab_study_paper.py's builder; the rest train.py's
GRIDS = [p for p in ALL if any(k in p.read_text() for k in ("AblationConfig(", "paper_grid("))]
CONFIGS = [p for p in ALL if p not in GRIDS]
GRID_COMMANDS = ("python -m eagle3_jax ablate", "benchmarks/vocab_study.py",
                 "benchmarks/fusion_ablation.py", "benchmarks/fusion_ablation_trained.py")  # fmt: skip


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig)
    assert "python train.py" in path.read_text()  # the launch command lives in the docstring


@pytest.mark.parametrize("path", GRIDS, ids=[p.stem for p in GRIDS])
def test_every_ablation_grid_loads(path):
    from eagle3_jax.ablation.config import AblationConfig, load_ablation

    grid = load_ablation(path)
    assert isinstance(grid, AblationConfig) and len(grid.cells) >= 2
    assert any(c in path.read_text() for c in GRID_COMMANDS)  # its launch command


def test_every_cell_of_the_default_target_s_grids_builds_its_head():
    """Each cell's head as training and decoding build it (draft_config, which checks the aux ids
    as decoding will), on the embedded default every such grid trains: a cell refused there would
    stop its grid hours in. The fusion ablation's top_layer cell reads id 30, the final normed
    state, and is the one head marked final_norm_aux."""
    from eagle3_jax.ablation.config import cell_config, load_ablation
    from eagle3_jax.checkpoints import load_target_config
    from eagle3_jax.training.prepare import draft_size
    from eagle3_jax.training.start import draft_config

    tcfg = load_target_config(None)
    marked = {}
    for path in GRIDS:
        grid = load_ablation(path)
        if grid.base.corpus.target is not None:
            continue
        for cell in grid.cells:
            tc = cell_config(grid, cell, Path(grid.out_dir), tcfg)
            dcfg = draft_config(tc, tcfg, draft_size(tc, tcfg.vocab_size))
            if dcfg.final_norm_aux:
                marked[f"{path.stem}/{cell.name}"] = dcfg.aux_layer_ids
    assert marked == {
        "fusion_ablation_smollm2/top_layer": (30,),
        "fusion_ablation_trained_smollm2/top_layer": (30,),
    }


def test_overrides_use_field_types():
    cfg = load_config(
        CONFIGS[0],
        [
            "--config.lr=2e-4",
            "--config.aux_layer_ids=1,5,9",
            "--config.regenerate=false",
            "--config.target=none",
            "--config.ttt_steps=3",
        ],
    )
    assert cfg.optim.lr == 2e-4 and cfg.head.aux_layer_ids == (1, 5, 9)
    assert cfg.corpus.regenerate is False
    assert cfg.corpus.target is None and cfg.head.ttt_steps == 3


@pytest.mark.parametrize(
    "override,msg",
    [
        ("--config.nope=1", "unknown config field"),
        ("--config.head.lr=1", r"unknown config field 'head.lr': lr is optim.lr"),
        ("--config.optim=1", "optim is a group of fields"),
        ("--config.optim.nope=1", "unknown config field"),
        ("--config.lr=fast", "not a valid"),
        ("--config.ttt_steps=0", "ttt_steps 0 < 1"),
        ("--config.features=disk", "use online or offline"),
        ("--config.log_every=0", "log_every 0 < 1"),
        ("--config.save_every=-1", "save_every -1 < 0"),
        ("--config.keep_checkpoints=0", "keep_checkpoints 0 < 1"),
        ("lr=1", "bad override"),
    ],
)
def test_bad_overrides(override, msg):
    with pytest.raises(Eagle3Error, match=msg):
        load_config(CONFIGS[0], [override])


def test_missing_config_file(tmp_path):
    with pytest.raises(Eagle3Error, match="does not exist"):
        load_config(tmp_path / "x.py")


@pytest.mark.parametrize(
    "field, value, msg",
    [
        ("lr", float("nan"), "lr nan: give a finite number"),
        ("lr", -1e-3, "lr -0.001"),
        ("beta2", 1.5, "beta2 1.5"),
        ("warmup_ratio", -0.1, "warmup_ratio -0.1"),
        ("max_len", 1.5, "max_len 1.5: give an integer"),
        ("mesh_data", 0, "mesh 0x1"),
    ],
)
def test_non_finite_or_out_of_range_settings_are_refused(field, value, msg):
    with pytest.raises(Eagle3Error, match=re.escape(msg)):
        TrainConfig().replace(**{field: value}).validate()


def test_field_names_are_unique_across_groups_and_never_a_group():
    """What lets `--config.lr` name optim.lr, and a flat record be read field by field."""
    names = [f for cls in GROUPS.values() for f in cls.__dataclass_fields__]
    assert len(names) == len(set(names)) == len(FIELDS) == 51
    assert not set(GROUPS) & set(FIELDS)


def test_a_field_by_its_group_or_its_name_alone():
    by_group = load_config(
        CONFIGS[0], ["--config.optim.lr=2e-4", "--config.head.aux_layer_ids=1,2"]
    )
    by_name = load_config(CONFIGS[0], ["--config.lr=2e-4", "--config.aux_layer_ids=1,2"])
    assert by_group == by_name and by_name.optim.lr == 2e-4
    tc = TrainConfig().replace(lr=1e-3, **{"head.ttt_steps": 3}, run=TrainConfig().run)
    assert tc.optim == OptimConfig(lr=1e-3) and tc.head.ttt_steps == 3
    with pytest.raises(Eagle3Error, match="unknown config field 'nope'"):
        TrainConfig().replace(nope=1)
    with pytest.raises(Eagle3Error, match=r"must be OptimConfig\(...\)"):
        TrainConfig(optim={"lr": 1.0}).validate()


def test_records_read_back_in_either_layout():
    """record() is nested by group; from_dict reads it, and the flat layout every record had
    before the groups, to the same config."""
    tc = load_config(ROOT / "configs/smollm2_135m.py", ["--config.feature_layers=2,15"])
    rec = tc.record()
    assert set(rec) == set(GROUPS) and rec["store"]["feature_layers"] == [2, 15]
    assert TrainConfig.from_dict(rec) == tc
    flat = flatten(rec)
    assert set(flat) == set(FIELDS) and flat["feature_layers"] == [2, 15]
    assert TrainConfig.from_dict(flat) == tc
    assert TrainConfig.from_dict({"lr": 3e-4}) == TrainConfig().replace(lr=3e-4)  # defaults
    with pytest.raises(Eagle3Error, match="unknown config field 'gone'"):
        TrainConfig.from_dict({**flat, "gone": 1})


FIXTURES = ROOT / "tests/fixtures/vocab_study"


def _old_record(name: str) -> dict:
    """A record the code before the groups wrote (flat), copied from the vocabulary study's
    runs/vocab_study/cells/; its absolute paths were this checkout's, /work/main."""
    return json.loads((FIXTURES / name).read_text().replace("/work/main", str(ROOT)))


@pytest.mark.parametrize("cell_name", ["eagle3_vd8192", "specvocab"])
def test_the_vocab_study_resumes_on_records_from_before_the_groups(cell_name, tmp_path):
    """The records of a running study, written flat by the code before the groups: the ablation
    runner accepts its cell.json, training accepts its train_config.json for --resume, and each
    reads back as the config that configs/vocab_study_smollm2.py gives today."""
    from eagle3_jax.ablation.config import (
        cell_config,
        cell_record,
        check_cell_config,
        load_ablation,
    )
    from eagle3_jax.checkpoints import load_target_config
    from eagle3_jax.training.run_dir import RESUMABLE, config_changes

    ac = load_ablation(ROOT / "configs/vocab_study_smollm2.py")
    cell = next(c for c in ac.cells if c.name == cell_name)
    tc = cell_config(ac, cell, Path(ac.out_dir), load_target_config(ac.base.corpus.target))
    saved_cell = _old_record(f"{cell_name}_cell.json")
    saved_run = _old_record(f"{cell_name}_train_config.json")
    assert "optim" not in saved_run and "lr" in saved_run  # the flat layout
    # the runner's own check, and the records field by field
    check_cell_config(cell, tmp_path, saved_cell, tc)
    # fields added since (schedule) read as their default
    assert flatten(cell_record(tc)) == {**saved_cell["config"], "schedule": "cosine"}
    # training's own --resume check, and from_dict of the old file
    assert config_changes(saved_run, tc) == []
    assert TrainConfig.from_dict(saved_run).record(RESUMABLE) == tc.record(RESUMABLE)
    # what today's code writes reads back as the same config
    assert config_changes(tc.record(RESUMABLE), tc) == []
    assert TrainConfig.from_dict(tc.record()) == tc
    # and a changed field is still named
    with pytest.raises(Eagle3Error, match=r"another config \(lr\)"):
        check_cell_config(cell, tmp_path, saved_cell, tc.replace(lr=1e-3))
    assert config_changes(saved_run, tc.replace(ttt_steps=3)) == ["ttt_steps"]
