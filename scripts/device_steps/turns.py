"""The shipped SmolLM2 head's next data step (`run`: regenerate every turn, grow the vocabulary,
continue the head) and its trees timed (`bench`)."""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
from pathlib import Path

from device_steps import common as c


def run(args) -> int:
    c.check_budget(args.minutes)
    out = Path(args.out or (c.ROOT / "runs" / "turns" / "out"))
    out.mkdir(parents=True, exist_ok=True)
    log = c.Log(c.TURNS.parent / "device_log.txt")
    log(f"start: {c.accelerator()}")
    try:
        env = c.env(args)
        if not args.target and not c.gguf_ready(log):
            return 1
        conversations = args.conversations or (
            c.FULL_CONVERSATIONS if c.FULL_CONVERSATIONS.exists() else c.SHIPPED_CONVERSATIONS
        )
        log(f"conversations: {conversations}")
        py = [sys.executable, "-m"]
        target = ["--target", args.target] if args.target else []
        regen_s = min(args.regen_minutes * 60, log.left(args.minutes) - args.reserve_s)
        c.phase(
            log,
            "regenerate",
            py + ["eagle3_jax", "regenerate", str(conversations), str(c.TURNS),
                  "--all-turns", "--max-len", "2048", "--batch-size", str(args.batch_size),
                  "--chunk", str(args.chunk), "--max-new-tokens", str(args.max_new_tokens),
                  "--max-batch-tokens", str(args.max_batch_tokens),
                  *(["--buckets", args.buckets] if args.buckets else []),
                  *([] if args.unrolled else ["--scan-layers"]),
                  "--no-progress", *target, *(["--limit", str(args.limit)] if args.limit else [])],
            env,
            regen_s,
        )  # fmt: skip
        answered = c.count_lines(c.TURNS)
        log(f"conversations answered in every turn: {answered}")
        pack_results(out, log)  # the answers are safe before the training starts
        if answered and not args.no_train:
            if c.TRAIN_OUT.exists():  # a timed run starts fresh; the answers are what carries over
                shutil.rmtree(c.TRAIN_OUT)
            grown = _extend_head(log, args, py, target, env)
            left_min = (log.left(args.minutes) - args.reserve_s) / 60
            c.phase(
                log,
                "train",
                py + ["eagle3_jax", "train-timed", f"--config={args.config}",
                      f"--minutes={left_min:.2f}", "--no-progress",
                      f"--config.out_dir={c.TRAIN_OUT}", "--config.save_every=0", *grown,
                      *args.train_arg,
                      *([f"--config.target={args.target}"] if args.target else [])],
                env,
                left_min * 60 + 30,  # timed.py keeps inside its budget; this is the backstop
            )  # fmt: skip
    finally:
        n = pack_results(out, log)
        log(f"packed {n} files into {out}")
    return 0


def _extend_head(log: c.Log, args, py: list[str], target: list[str], env: dict) -> list[str]:
    """Grows the shipped head's draft vocabulary to --extend-vocab ids before it is continued
    (8,192 ids cover 91.6 % of MT-bench's answer tokens, 16,384 cover 96.3 %: the new rows then
    train instead of starting from the row map alone). Returns the training's config overrides;
    none (the shipped head as it is) when disabled, when the head has that many ids already (the
    shipped head has 16,384) or when the step fails."""
    if not args.extend_vocab:
        return []
    have = json.loads((c.SHIPPED_HEAD / "config.json").read_text())["draft_vocab_size"]
    if have >= args.extend_vocab:
        log(f"extend: the shipped head has {have} ids already (--extend-vocab {args.extend_vocab})")
        return []
    if not c.COUNTS.exists():
        log(
            f"extend: no {c.COUNTS.relative_to(c.ROOT)} (pack writes it): the shipped head as it is"
        )
        return []
    if c.EXTENDED_HEAD.exists():
        shutil.rmtree(c.EXTENDED_HEAD)
    rc = c.phase(
        log,
        "extend",
        py + ["eagle3_jax", "vocab", "extend", "--draft", str(c.SHIPPED_HEAD),
              "--counts", str(c.COUNTS), "--size", str(args.extend_vocab),
              "--out", str(c.EXTENDED_HEAD), *target],
        env,
        120,
    )  # fmt: skip
    if rc != 0 or not (c.EXTENDED_HEAD / "config.json").exists():
        log("extend: failed; the shipped head as it is")
        return []
    return [
        f"--config.init_head={c.EXTENDED_HEAD}",
        f"--config.draft_vocab_size={args.extend_vocab}",
    ]


def bench(args) -> int:
    """The shipped head's tree shapes timed on the accelerator (MT-bench, one question per
    category): what decode.py's accelerator default (10,8,60) buys over the CPU's small tree
    there. Run after `run` in the same lease (the GGUF is joined by then) or after the `check`
    calls; the records are written as each finishes, so a run its own deadline stops still
    returns them (one the device tool kills returns nothing: keep --minutes under its limit).
    Returns 1 when the evaluation failed or was cut off."""
    c.check_budget(args.minutes)
    out = Path(args.out or (c.ROOT / "runs" / "turns" / "out"))
    out.mkdir(parents=True, exist_ok=True)
    log = c.Log(c.TURNS.parent / "device_log.txt")
    log(f"bench start: {c.accelerator()}")
    rc = 1
    try:
        env = c.env(args)
        if not args.target and not c.gguf_ready(log):
            return 1
        extra = (
            (["--draft", args.draft] if args.draft else [])
            + (["--target", args.target] if args.target else [])
            + (["--dtype", args.dtype] if args.dtype else [])
        )
        rc = c.phase(
            log,
            "bench",
            [sys.executable, "-m", "eagle3_jax", "eval", "--bench", "mt_bench",
             "--questions", str(args.questions), "--max-new-tokens", str(args.max_new_tokens),
             "--methods", args.methods, "--out", str(c.BENCH_OUT), "--no-progress", *extra],
            env,
            log.left(args.minutes) - 20,
        )  # fmt: skip
    finally:
        with tarfile.open(out / "bench.tar.gz", "w:gz") as t:
            for p in [*sorted(c.BENCH_OUT.glob("*")), c.TURNS.parent / "bench.log", log.path]:
                if p.is_file():
                    t.add(p, arcname=p.name)
        log(f"packed {out / 'bench.tar.gz'}")
    return 0 if rc == 0 else 1


def pack_results(out: Path, log: c.Log) -> int:
    """Answers (gzip) and the trained head (tar), each split into 15 MiB parts, and one tar of the
    metrics, plan, config and logs: at most 8 files of at most 16 MiB come back."""
    import gzip

    files = []
    work = c.TURNS.parent
    for old in out.glob("*.part*"):  # an earlier packing of this run (after the answers)
        old.unlink()
    if c.TURNS.exists():
        data = c.TURNS.read_bytes()
        gz = work / "regenerated_turns.jsonl.gz"
        gz.write_bytes(gzip.compress(data[: data.rfind(b"\n") + 1], 9))  # whole records only
        files += c.split_file(gz, out, int(c.PART_MIB * c.MIB), gz.name)
    if (c.TRAIN_OUT / "head").is_dir():
        tar = work / "head.tar"
        with tarfile.open(tar, "w") as t:
            t.add(c.TRAIN_OUT / "head", arcname="head")
        files += c.split_file(tar, out, int(c.PART_MIB * c.MIB), tar.name)
    small = [
        c.TRAIN_OUT / n
        for n in ("metrics.jsonl", "validation.jsonl", "timed.json", "train_config.json")
    ]
    cal = c.TRAIN_OUT.with_name(c.TRAIN_OUT.name + "_calibration") / "metrics.jsonl"
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
