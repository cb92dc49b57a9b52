"""A persistent XLA compilation cache for the command-line tools.

Every `decode.py`, `make demo`, evaluation, validation or training run compiles the same programs
again (the target's prefill and decode steps, a round of speculative decoding, the train step):
tens of seconds on a laptop CPU before the first token. JAX can keep compiled programs on disk;
the tools switch that on (`enable`), so a second run with the same shapes skips compiling.

* Where: `<EAGLE3_JAX_CACHE or ~/.cache/eagle3_jax>/xla/<machine key>`. XLA compiles CPU code for
  the host's instruction set, so the key names the CPU model, its feature flags (Linux; elsewhere
  the processor name only) and the jax version: a home directory shared by different machines
  never loads code built for another CPU.
* `EAGLE3_JAX_COMPILATION_CACHE=0` leaves the cache off; `JAX_COMPILATION_CACHE_DIR` (JAX's own
  setting, which JAX reads itself) is left alone when set, and then it is JAX's cache. Library
  calls (and the tests) are untouched: only the entry points call `enable`.

`release_if_crowded` keeps a long-lived process (the evaluation harness calls it before every
generation) under Linux's limit on memory mappings, which compiled XLA:CPU programs use up.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

from eagle3_jax.paths import cache_dir, cpu_fields

ENV = "EAGLE3_JAX_COMPILATION_CACHE"
MAX_BYTES = 2 * 2**30  # a few hundred kB a program: room for every tool's shapes


def machine_key(cpuinfo: str | None = None) -> str:
    """A short name for this host's compiler target: CPU model and flags (from /proc/cpuinfo, or
    `cpuinfo`; the processor name where there is none) and the jax version."""
    import jax

    model, flags = cpu_fields(cpuinfo)
    digest = hashlib.sha256(f"{model}|{flags}|jax {jax.__version__}".encode()).hexdigest()
    return f"{platform.machine()}-{digest[:16]}"


def enable() -> Path | None:
    """Turns on JAX's persistent compilation cache for this process (see the module docstring).
    Returns the directory in use, or None when switched off. Call before the first compilation."""
    import jax

    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # JAX reads it itself
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    path = cache_dir() / "xla" / machine_key()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only home: compile as before
    if not os.access(path, os.W_OK):
        return None  # JAX would warn at every compilation
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)  # least recently used go first
    return path


# Compiled programs held in memory, not on disk: XLA:CPU maps every compiled kernel's code into
# the process separately (measured with the SmolLM2 target: ~1,900 memory mappings for one
# speculative program, i.e. a prefill and a round loop for one prompt-length bucket), and Linux
# caps a process's mappings (vm.max_map_count, 65,530 by default). A process that keeps ~30 such
# programs (an evaluation of several methods over many prompt lengths, an ablation grid) reaches
# the cap and the next compilation aborts the process ("LLVM compilation error: Cannot allocate
# memory"), though the machine has memory to spare.
MAP_FRACTION = 0.6
_floor = 0  # mappings left after the last clearing: what clearing cannot give back


def _map_counts() -> tuple[int, int] | None:
    """(memory mappings of this process, the kernel's limit), or None where /proc has no answer."""
    try:
        with open("/proc/self/maps", "rb") as f:
            used = f.read().count(b"\n")
        with open("/proc/sys/vm/max_map_count", encoding="ascii") as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return None
    return used, limit


def release_if_crowded(fraction: float = MAP_FRACTION) -> bool:
    """Drops JAX's in-memory compiled programs (`jax.clear_caches`) when this process's memory
    mappings exceed `fraction` of the kernel's limit (see MAP_FRACTION's comment), so long-lived
    tools compile on instead of aborting; a program needed again is compiled again (loaded from
    the persistent cache where `enable` switched it on). Call it between units of work, never
    inside a timed region. Returns True when it cleared; a no-op (False) off Linux. Mappings that
    clearing left (held by something else) do not count towards the next clearing, which waits
    for another tenth of the limit on top of them."""
    global _floor
    counts = _map_counts()
    if counts is None:
        return False
    used, limit = counts
    if used <= fraction * limit or (_floor and used <= _floor + limit // 10):
        return False
    import gc
    import sys

    import jax

    jax.clear_caches()
    gc.collect()
    after = _map_counts()
    _floor = after[0] if after else 0
    left = f"{after[0]:,}" if after else "?"
    print(
        f"compile_cache: {used:,} memory mappings of {limit:,} allowed: dropped the "
        f"compiled programs held in memory ({left} mappings left)",
        file=sys.stderr,
    )
    return True
