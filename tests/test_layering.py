"""The package is layered downward, and the import graph says so.

  0  errors, config, paths, sharding and the leaf helpers (file formats, prompts, the data readers,
     tree shapes, sampling settings, benchmark questions, result files and their metrics (τ,
     acceptance), training config)
  1  models/ (pure functions of params and a config), the CPU product probes, what decoding does
     by backend (backends.py), and the cost model
     (accelerators/: specs, roofline, acceptance, hbm, predict)
  2  checkpoints/ and vocab/ (reading, writing and cutting heads and targets)
  3  decoding/ (continuous batching over slots included), training/, and the data jobs built
     on them (regeneration, prompt selection)
  4  evaluation/, serving/ (the HTTP server), the ablation runner, and the programs lowered for
     accelerators (accelerators.programs, accelerators.lowering)
  5  cli/ (every command line) and the public API (eagle3_jax/__init__.py)

A module imports only from its own rank or below, never in a circle, and only at module top (an
import inside a function hides an edge from this test and from the reader).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "eagle3_jax"

RANKS = {
    "eagle3_jax.errors": 0,
    "eagle3_jax.config": 0,
    "eagle3_jax.paths": 0,
    "eagle3_jax.sharding": 0,
    "eagle3_jax.prompts": 0,
    "eagle3_jax.heads": 0,
    "eagle3_jax.compile_cache": 0,
    "eagle3_jax.distributed": 0,
    "eagle3_jax.checkpoints.atomic": 0,
    "eagle3_jax.checkpoints.safetensors_io": 0,
    "eagle3_jax.checkpoints.layouts": 0,
    "eagle3_jax.data": 0,
    "eagle3_jax.data.conversations": 0,
    "eagle3_jax.data.masks": 0,
    "eagle3_jax.data.dataset": 0,
    "eagle3_jax.decoding": 0,
    "eagle3_jax.decoding.tree": 0,
    "eagle3_jax.decoding.sampling": 0,
    "eagle3_jax.evaluation": 0,
    "eagle3_jax.evaluation.questions": 0,
    "eagle3_jax.evaluation.metrics": 0,
    "eagle3_jax.evaluation.records": 0,
    "eagle3_jax.training": 0,
    "eagle3_jax.training.config": 0,
    "eagle3_jax.training.tensorboard": 0,
    "eagle3_jax.training.checkpoint": 0,
    "eagle3_jax.vocab": 0,
    "eagle3_jax.models": 1,
    "eagle3_jax.cpu_tuning": 1,
    "eagle3_jax.backends": 1,
    "eagle3_jax.accelerators": 1,
    "eagle3_jax.checkpoints": 2,
    "eagle3_jax.vocab.methods": 2,
    "eagle3_jax.decoding.plain": 3,
    "eagle3_jax.decoding.state": 3,
    "eagle3_jax.decoding.drafters": 3,
    "eagle3_jax.decoding.verify": 3,
    "eagle3_jax.decoding.speculative": 3,
    "eagle3_jax.decoding.generate": 3,
    "eagle3_jax.decoding.replay": 3,
    "eagle3_jax.decoding.slots": 3,
    "eagle3_jax.training.features": 3,
    "eagle3_jax.training.step": 3,
    "eagle3_jax.training.ttt": 3,
    "eagle3_jax.training.loop": 3,
    "eagle3_jax.training.prepare": 3,
    "eagle3_jax.training.run_dir": 3,
    "eagle3_jax.training.start": 3,
    "eagle3_jax.training.validate": 3,
    "eagle3_jax.training.timed": 3,
    "eagle3_jax.data.regenerate": 3,
    "eagle3_jax.data.regen_output": 3,
    "eagle3_jax.data.select_prompts": 3,
    "eagle3_jax.serving": 4,
    "eagle3_jax.evaluation.options": 4,
    "eagle3_jax.evaluation.fingerprint": 4,
    "eagle3_jax.evaluation.batch": 4,
    "eagle3_jax.evaluation.runner": 4,
    "eagle3_jax.evaluation.report": 4,
    "eagle3_jax.evaluation.paired": 4,
    "eagle3_jax.evaluation.study": 4,
    "eagle3_jax.evaluation.grid_report": 4,
    "eagle3_jax.evaluation.budget_report": 4,
    "eagle3_jax.ablation": 4,
    "eagle3_jax.accelerators.programs": 4,
    "eagle3_jax.accelerators.lowering": 4,
    "eagle3_jax.cli": 5,
    "eagle3_jax.__main__": 5,
    "eagle3_jax": 5,
}


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def rank(name: str) -> int:
    """The rank of a module: its own entry, else its package's (models.* -> models)."""
    while name not in RANKS:
        assert "." in name, f"{name} has no rank in tests/test_layering.py: give it one"
        name = name.rsplit(".", 1)[0]
    return RANKS[name]


def imports(path: Path, mods: dict[str, Path]) -> tuple[set[str], list[str]]:
    """(eagle3_jax modules imported, imports found inside functions or classes)."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    found, inner = set(), []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "eagle3_jax":
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "eagle3_jax"]
        names = [n for n in names if n in mods]
        if names and id(node) not in top:
            inner.append(f"line {node.lineno}: {ast.unparse(node)}")
        found.update(names)
    return found, inner


def graph():
    mods = modules()
    return {m: imports(p, mods) for m, p in mods.items()}


def test_every_module_imports_downward_at_module_top():
    bad = []
    for mod, (deps, inner) in graph().items():
        bad += [f"{mod} imports inside a function ({i})" for i in inner]
        for dep in deps:
            if dep != mod and not mod.startswith(dep + ".") and rank(dep) > rank(mod):
                bad.append(f"{mod} (rank {rank(mod)}) imports {dep} (rank {rank(dep)})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circles():
    edges = {
        m: {d for d in deps if d != m and not m.startswith(d + ".")}
        for m, (deps, _) in graph().items()
    }
    state: dict[str, int] = {}
    circles = []

    def visit(m, path):
        state[m] = 1
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                circles.append(" -> ".join(path[path.index(d) :] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not circles, "\n".join(circles)


def test_library_modules_have_no_command_line():
    """Command lines live in cli/ alone: a library module has no main() and no __main__ block."""
    bad = []
    for mod, path in modules().items():
        if rank(mod) == 5:
            continue
        tree = ast.parse(path.read_text())
        for n in tree.body:
            if isinstance(n, ast.FunctionDef) and n.name == "main":
                bad.append(f"{mod} defines main()")
            if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test):
                bad.append(f"{mod} has an `if __name__ == '__main__'` block")
    assert not bad, "\n".join(bad)
