"""Every shipped config loads; overrides are typed; bad configs are refused clearly."""

import re
from pathlib import Path

import pytest

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.training.config import TrainConfig, load_config

ALL = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.py"))
GRIDS = [p for p in ALL if "AblationConfig(" in p.read_text()]  # python -m eagle3_jax ablate
CONFIGS = [p for p in ALL if p not in GRIDS]  # train.py


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig)
    assert "python train.py" in path.read_text()  # the launch command lives in the docstring


@pytest.mark.parametrize("path", GRIDS, ids=[p.stem for p in GRIDS])
def test_every_ablation_grid_loads(path):
    from eagle3_jax.ablation import AblationConfig, load_ablation

    grid = load_ablation(path)
    assert isinstance(grid, AblationConfig) and len(grid.cells) >= 2
    assert "python -m eagle3_jax ablate" in path.read_text()


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
    assert cfg.lr == 2e-4 and cfg.aux_layer_ids == (1, 5, 9) and cfg.regenerate is False
    assert cfg.target is None and cfg.ttt_steps == 3


@pytest.mark.parametrize(
    "override,msg",
    [
        ("--config.nope=1", "unknown config field"),
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
    import dataclasses

    from eagle3_jax.training.config import TrainConfig

    with pytest.raises(Eagle3Error, match=re.escape(msg)):
        dataclasses.replace(TrainConfig(), **{field: value}).validate()
