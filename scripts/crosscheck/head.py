"""The head's config as the official loader reads it: the random-embedding case, the config copy
that avoids it, the layers it feeds a draft and its tree arguments (stdlib only: the official
worker and the tests import it too)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

EMBED_KEY = "embed_tokens.weight"


def safetensors_keys(path: str | os.PathLike) -> set[str]:
    """Tensor names in one safetensors file, from its header alone."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return set(header)


def official_embedding_issue(head: str | os.PathLike) -> str | None:
    """Why the official `cnets.Model` would draft from a randomly initialised embedding with this
    head, or None. It copies the target's `model.embed_tokens.weight` into the draft only when the
    head's config.json has no `target_hidden_size` key; with the key it expects the head's own
    `embed_tokens.weight` in model.safetensors, and, finding none, keeps nn.Embedding's random
    init without a word (load_state_dict(strict=False))."""
    head = Path(head)
    cfg = json.loads((head / "config.json").read_text())
    if "target_hidden_size" not in cfg:
        return None
    files = sorted(head.glob("*.safetensors"))
    if any(EMBED_KEY in safetensors_keys(f) for f in files):
        return None
    ths, hs = cfg["target_hidden_size"], cfg.get("hidden_size")
    if ths == hs:
        return (
            f"{head / 'config.json'} names target_hidden_size ({ths}, = hidden_size) and its "
            f"safetensors hold no {EMBED_KEY}: the official code (cnets.Model) then skips the "
            "target's embedding and drafts from a RANDOM one; --fix-config-copy runs it on a "
            "copy of the head without that key"
        )
    return (
        f"{head / 'config.json'} names target_hidden_size {ths} != hidden_size {hs} and its "
        f"safetensors hold no {EMBED_KEY}: the official code drafts from a random embedding, and "
        "no edit of config.json can give this head one of its width"
    )


def fixed_config_copy(head: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """A copy of the head in `dest` (its files symlinked, or copied where links fail) whose
    config.json lacks `target_hidden_size`, so that the official loader reads the target's
    embedding. Refused where the key differs from hidden_size (no embedding of that width)."""
    head, dest = Path(head), Path(dest)
    cfg = json.loads((head / "config.json").read_text())
    ths = cfg.pop("target_hidden_size", None)
    if ths is not None and ths != cfg.get("hidden_size"):
        raise SystemExit(
            f"--fix-config-copy: target_hidden_size {ths} != hidden_size {cfg.get('hidden_size')}"
            " in the head: removing the key would not give it a fitting embedding"
        )
    dest.mkdir(parents=True, exist_ok=True)
    for f in head.iterdir():
        if f.name == "config.json" or not f.is_file():
            continue
        try:
            (dest / f.name).symlink_to(f.resolve())
        except OSError:
            shutil.copy2(f, dest / f.name)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dest


def official_aux_ids(num_layers: int) -> list[int]:
    """The layers whose outputs the official Llama code feeds the draft (modeling_llama_kv keeps
    the inputs of layers 2, L//2 and L-3), as config.json's eagle_aux_hidden_state_layer_ids."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def official_tree(top_k: int, depth: int, total_tokens: int) -> dict[str, int]:
    """EaModel.from_pretrained's tree arguments for our TreeConfig(top_k, depth, total_tokens)."""
    return {"top_k": top_k, "depth": depth - 1, "total_token": total_tokens}
