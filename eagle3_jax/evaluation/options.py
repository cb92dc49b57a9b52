"""What an evaluation runs: its options (the command-line flags, `EvalOptions`), the methods they
name (`MethodSpec`, `parse_methods`: vanilla, pld and eagle3 with their trees), the drafts and
how each is cut (--draft, --draft-vocab), and the seeds."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path

from eagle3_jax.checkpoints.heads import parse_draft_vocab
from eagle3_jax.decoding.tree import TreeConfig, default_tree
from eagle3_jax.errors import Eagle3Error


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A method to evaluate: `label` names it in records and reports."""

    label: str
    kind: str  # vanilla | pld | eagle3
    tree: tuple = (1, 1, 1)  # top_k, depth, total_tokens[, verify_threshold]
    draft: str | None = None  # a draft name (eagle3 only)


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """Everything one evaluation run needs (the command-line flags)."""

    out: Path
    target: str | None = None
    drafts: tuple[str, ...] = ()
    methods: str | None = None
    bench: str = "spec_bench"
    questions: int | None = None
    temperature: float = 0.0
    max_new_tokens: int = 256
    seeds: int | None = None
    batch_size: int = 1
    dtype: str | None = None
    progress: bool = True
    baseline: bool = True  # run vanilla too (speedup, exactness); False: tau only
    draft_vocab: tuple[str, ...] = ()  # --draft-vocab [NAME=]auto|full|N; unnamed: every draft
    mesh: str | None = None  # --mesh DATAxMODEL; records do not depend on it (not fingerprinted)
    replay: bool = False  # speculative methods' τ replayed over vanilla's answers (decoding.replay)


def parse_drafts(specs: Sequence[str]) -> dict[str, str]:
    """`PATH` or `name=PATH` (repeatable) -> {name: absolute path}; a bare PATH is named by its
    directory name."""
    out: dict[str, str] = {}
    for s in specs:
        name, sep, path = s.partition("=")
        if not sep or "/" in name or not name:
            name, path = Path(s).name or s, s
        if name in out:
            raise Eagle3Error(
                f"two drafts are named {name!r}: give them names with --draft NAME=PATH"
            )
        out[name] = str(Path(path).expanduser().resolve())
    return out


def parse_draft_vocab_specs(specs: Sequence[str], drafts: dict[str, str]) -> dict[str, object]:
    """--draft-vocab values (`auto`, `full`, `N`, or `NAME=` one of these for one draft; later
    ones win) -> {draft name: request}; drafts not named keep "auto" (decode.py's default)."""
    out: dict[str, object] = {n: "auto" for n in drafts}
    for text in specs:
        name, sep, value = text.rpartition("=")
        if sep and name not in drafts:
            raise Eagle3Error(
                f"--draft-vocab {text!r}: no draft named {name!r} (have {', '.join(drafts)})"
            )
        req = parse_draft_vocab(value)
        out.update({name: req} if sep else dict.fromkeys(drafts, req))
    return out


def _parse_tree(text: str, where: str) -> tuple:
    """`K,D,T` or `K,D,T,THRESHOLD` (adaptive verification) -> (k, d, t[, threshold])."""
    parts = text.split(",")
    try:
        if len(parts) not in (3, 4):
            raise ValueError
        shape = tuple(int(x) for x in parts[:3]) + tuple(float(x) for x in parts[3:])
    except ValueError:
        raise Eagle3Error(
            f"method {where!r}: the tree shape must be TOP_K,DEPTH,TOTAL[,VERIFY_THRESHOLD]"
        ) from None

    TreeConfig(*shape).validate(10**9)
    return shape


def default_tree_shape() -> tuple:
    """A bare `eagle3` (or `pld`): decode.py's default tree on this backend, as a shape tuple."""

    t = default_tree()
    shape = (t.top_k, t.depth, t.total_tokens)
    return shape + ((t.verify_threshold,) if t.verify_threshold > 0 else ())


def shape_text(tree: tuple) -> str:
    """(2, 3, 4, 0.3) -> "2,3,4,0.3": a tree shape as --methods writes it."""
    return ",".join(str(x) if isinstance(x, int) else f"{x:g}" for x in tree)


def parse_methods(
    text: str | None, drafts: dict[str, str], baseline: bool = True
) -> list[MethodSpec]:
    """A comma list of `vanilla`, `pld[:k,d,t]`, `eagle3[:k,d,t][@draft]` -> specs, vanilla first
    (run unless baseline is False: speedup and exactness are measured against it). A bare
    `eagle3` with several drafts runs each draft. A bare `eagle3` or `pld` is labelled with the
    shape it resolves to on this backend (`eagle3:2,3,4,0.3` on a CPU), so records and reports
    of a CPU and an accelerator run never share a label for different trees."""
    if text is None:
        text = "vanilla,pld" + (",eagle3" if drafts else "")
    # commas separate methods, except inside a tree shape ("eagle3:4,4,16,.3,pld")
    joined = [x.strip() for x in re.split(r",(?!\s*\.?\d)", text) if x.strip()]
    if not baseline and "vanilla" in joined:
        raise Eagle3Error("--no-baseline skips vanilla: drop it from --methods")
    specs = [MethodSpec("vanilla", "vanilla", (1, 1, 1))] if baseline else []
    for it in joined:
        head, _, name = it.partition("@")
        kind, colon, shape = head.partition(":")
        if kind not in ("vanilla", "pld", "eagle3"):
            raise Eagle3Error(f"unknown method {it!r}: use vanilla, pld[:k,d,t], eagle3[:k,d,t]")
        if kind == "vanilla":
            continue
        tree = _parse_tree(shape, it) if colon else default_tree_shape()
        if kind == "pld":  # a chain of the shape's depth (a bare pld's threshold does not apply)
            if name:
                raise Eagle3Error(f"method {it!r}: pld takes no draft")
            if colon and len(tree) > 3:
                raise Eagle3Error(f"method {it!r}: a verify threshold needs a draft (eagle3)")
            chain = (1, tree[1], tree[1] + 1)
            specs.append(MethodSpec(head if colon else f"pld:{shape_text(chain)}", "pld", chain))
            continue
        if not drafts:
            raise Eagle3Error(f"method {it!r} needs --draft PATH (an EAGLE-3 head)")
        if name and name not in drafts:
            raise Eagle3Error(f"method {it!r}: no draft named {name!r} (have {', '.join(drafts)})")
        names = [name] if name else list(drafts)
        if not colon:
            head = f"eagle3:{shape_text(tree)}"
        for n in names:
            label = head if len(drafts) == 1 else f"{head}@{n}"
            specs.append(MethodSpec(label, "eagle3", tree, n))
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise Eagle3Error(f"methods repeat: {', '.join(labels)}")
    return specs


def num_seeds(opts: EvalOptions) -> int:
    return opts.seeds if opts.seeds is not None else (1 if opts.temperature == 0 else 5)
