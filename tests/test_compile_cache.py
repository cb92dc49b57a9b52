"""The command-line tools' persistent compilation cache: a second process loads what the first
compiled, keyed by machine; off when asked, and JAX's own setting wins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from eagle3_jax import compile_cache, paths

PROBE = """
import jax, jax.numpy as jnp
from eagle3_jax import compile_cache
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
path = compile_cache.enable()
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
y = jax.jit(lambda x: jnp.tanh(x) @ x.T)(jnp.arange(64.0).reshape(8, 8) / 64)
hits = sum(e.endswith("compilation_cache/cache_hits") for e in events)
misses = sum(e.endswith("compilation_cache/cache_misses") for e in events)
print(path, repr(float(y.sum())), hits, misses)
"""


def _probe(home: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(EAGLE3_JAX_CACHE=str(home), EAGLE3_JAX_COMPILATION_CACHE="1")
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def test_second_process_loads_the_first_ones_programs(tmp_path):
    path, y1, hits1, misses1 = _probe(tmp_path)
    assert Path(path) == tmp_path / "xla" / compile_cache.machine_key()
    assert int(hits1) == 0 and int(misses1) > 0
    assert any(p.name.endswith("-cache") for p in Path(path).iterdir())
    path2, y2, hits2, misses2 = _probe(tmp_path)
    assert path2 == path and y2 == y1
    assert int(hits2) > 0 and int(misses2) == 0  # every program came from disk


def test_off_and_jax_setting_win(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3_JAX_CACHE", str(tmp_path))
    monkeypatch.setenv(compile_cache.ENV, "0")
    assert compile_cache.enable() is None
    assert not (tmp_path / "xla").exists()
    monkeypatch.setenv(compile_cache.ENV, "1")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.enable() == tmp_path / "mine"
    assert not (tmp_path / "xla").exists()


def test_machine_key_follows_the_cpu_model_and_flags():
    key = compile_cache.machine_key()
    assert key == compile_cache.machine_key()
    arch, _, digest = key.partition("-")
    assert arch and len(digest) == 16
    info = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: sse2 avx2 fma\n"
    same = info.replace("sse2 avx2 fma", "fma sse2 avx2") + "processor\t: 1\n"
    assert compile_cache.machine_key(info) == compile_cache.machine_key(same)
    assert compile_cache.machine_key(info) == compile_cache.machine_key(info + "bogomips\t: 1\n")
    assert compile_cache.machine_key(info) != compile_cache.machine_key(
        info.replace("avx2", "avx2 avx512f")
    )
    assert compile_cache.machine_key(info) != compile_cache.machine_key(
        info.replace("Some CPU", "Other CPU")
    )
    # the model name alone, as benchmark records and the product probes' cache name the CPU
    assert paths.cpu_model(info + "model name\t: Second CPU\n") == "Some CPU"
    assert paths.cpu_model("") and paths.cpu_model() == paths.cpu_model()


def test_release_if_crowded_drops_compiled_programs_near_the_map_limit(monkeypatch, capsys):
    """Under the limit nothing happens; past `fraction` of it the programs held in memory go (a
    jitted function's cache empties, and on Linux the process's mappings shrink), and a message
    says so; with no /proc (not Linux) it is a no-op."""
    # as in a fresh process: the suite's own guard (conftest.py) may have cleared earlier in this
    # worker, and the floor it left would hold off the first clearing below
    monkeypatch.setattr(compile_cache, "_floor", 0)
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: jnp.sin(x) * 2)
    f(jnp.ones(3))
    assert f._cache_size() == 1
    assert not compile_cache.release_if_crowded(1.0)  # never past the whole limit
    assert f._cache_size() == 1
    real = compile_cache._map_counts()
    if real is not None:  # Linux: the real counts, a fraction every process exceeds
        assert compile_cache.release_if_crowded(0.0)
        assert f._cache_size() == 0
        assert "memory mappings of" in capsys.readouterr().err
        f(jnp.ones(3))  # compiles again
    monkeypatch.setattr(compile_cache, "_floor", 0)
    monkeypatch.setattr(compile_cache, "_map_counts", lambda: (700, 1000))
    assert compile_cache.release_if_crowded() and f._cache_size() == 0
    f(jnp.ones(3))
    # 700 stayed (the stub does not shrink): cleared again only 100 (a tenth) above that
    assert not compile_cache.release_if_crowded() and f._cache_size() == 1
    monkeypatch.setattr(compile_cache, "_map_counts", lambda: (801, 1000))
    assert compile_cache.release_if_crowded() and f._cache_size() == 0
    f(jnp.ones(3))
    monkeypatch.setattr(compile_cache, "_floor", 0)
    monkeypatch.setattr(compile_cache, "_map_counts", lambda: (500, 1000))
    assert not compile_cache.release_if_crowded() and f._cache_size() == 1
    monkeypatch.setattr(compile_cache, "_map_counts", lambda: None)
    assert not compile_cache.release_if_crowded(0.0)
