"""An evaluation run's records on disk: results.json, or the same gzipped (how the runs under
benchmarks/results are committed). Read by the harness when it resumes, by validation (replayed
answers) and by the benchmarks; depends on nothing else in the package."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from eagle3_jax.errors import Eagle3Error


def read_results(path: str | Path) -> dict:
    """An evaluation run's results.json, or the same gzipped (results.json.gz: how the runs under
    benchmarks/results are committed, a tenth of the size)."""
    path = Path(path)
    if not path.is_file():
        raise Eagle3Error(f"evaluation results {path} do not exist")
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            res = json.load(f)
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as e:  # BadGzipFile is an OSError
        raise Eagle3Error(f"cannot read evaluation results {path}: {e}") from e
    if not isinstance(res, dict) or "records" not in res or "config" not in res:
        raise Eagle3Error(f"{path} is not an evaluation results.json (no config and records)")
    return res
