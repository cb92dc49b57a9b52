"""Files and directories written atomically, and never over what a user made.

A directory is built in a temporary sibling and renamed into place when complete, so a reader (or a
run killed mid-write) never sees half of it. Every directory written this way holds a marker file,
`MARKER`: an existing destination is replaced only when it carries that marker (the project wrote
it) and the caller allows replacing; an empty directory is taken over; anything else a user has at
that path (a folder of other files, a file, a head we did not write) is refused with one line and
left exactly as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from eagle3_jax.errors import Eagle3Error, differing_keys

MARKER = ".eagle3_jax"  # in every directory atomic_directory writes


def written_by_us(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory this project wrote (it holds the marker file)."""
    return (Path(path) / MARKER).is_file()


def _inside(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


def check_destination(
    path: str | os.PathLike,
    overwrite: bool = False,
    sources: Iterable[str | os.PathLike] = (),
    what: str = "output",
) -> None:
    """Refuses, before any work, a destination that writing there would destroy or mix.

    Allowed: a path that does not exist, an empty directory, or (with `overwrite`) a directory
    this project wrote. Refused: a file, a directory of anything else, one written by us without
    `overwrite`, and a destination equal to, inside or around one of `sources` (the inputs the
    job reads).
    """
    path = Path(path)
    real = path.resolve()
    for src in sources:
        s = Path(src).resolve()
        if _inside(real, s) or _inside(s, real):
            raise Eagle3Error(
                f"{what} {path} is the same as, inside or around the input {src}: write to a "
                "new path beside it"
            )
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir():
        raise Eagle3Error(f"{what} {path} exists and is not a directory: choose a new path")
    if not any(path.iterdir()):
        return
    if not written_by_us(path):
        raise Eagle3Error(
            f"{what} {path} already holds files eagle3_jax did not write: choose a new or "
            "empty directory (nothing there was changed)"
        )
    if not overwrite:
        raise Eagle3Error(
            f"{what} {path} already exists: pass --overwrite to replace it, or choose a new path"
        )


@contextlib.contextmanager
def atomic_directory(
    path: str | os.PathLike, overwrite: bool = True, sources: Iterable = ()
) -> Iterator[Path]:
    """Yields a temporary directory; on success it takes the place of `path`, on any error it is
    removed. `path` must pass `check_destination(path, overwrite, sources)`: what it replaces is
    an empty directory or one this project wrote (moved aside first, removed after the rename)."""
    path = Path(path)
    check_destination(path, overwrite, sources)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        (tmp / MARKER).write_text("written by eagle3_jax; replaced only by it\n")
        yield tmp
        check_destination(path, overwrite, sources)  # nobody filled it in the meantime
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old."))
            os.replace(path, old / "x")
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """`path.write_text(text)`, but a kill mid-write leaves the old file, never half of the new."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _lock_path(path: Path) -> Path:
    """Where `path`'s lock lives: a directory's `.lock` inside it, a file's `<file>.lock` beside."""
    return path / ".lock" if path.is_dir() else path.with_name(path.name + ".lock")


@contextlib.contextmanager
def exclusive(path: str | os.PathLike, what: str = "output") -> Iterator[None]:
    """An advisory lock (fcntl) held while a job writes `path` (a directory: its `.lock` file; a
    file: `<file>.lock` beside it). A second writer is refused at once with one line naming the
    holder's pid; the lock goes with the process (a killed job leaves nothing to clean up)."""
    import fcntl

    lock = _lock_path(Path(path))
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            for wait in (0.05, 0.2, None):  # `holder` (--status) takes the lock for an instant
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if wait is None:
                        raise
                    time.sleep(wait)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise Eagle3Error(
                f"{what} {path} is being written by another process (pid {holder}): wait for it "
                "to finish, or choose another path"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def holder(path: str | os.PathLike) -> str | None:
    """The pid (as `exclusive` wrote it) of the process holding `path`'s lock, or None when no
    process holds it. Reads only: the lock is tried shared and let go at once, nothing written."""
    import fcntl

    try:
        fd = os.open(_lock_path(Path(path)), os.O_RDONLY)
    except OSError:  # never locked (or unreadable): nobody holds it
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def made_from(path: str | os.PathLike, inputs: dict, what: str = "output") -> bool:
    """Whether `path`, a derived file or directory, exists and was made from `inputs` (a record
    of digests and settings that decide it, kept beside it in `<path>.inputs.json` by `record_inputs`).

    False: it does not exist yet (make it, then `record_inputs`). An existing `path` made from
    other inputs, or with no record of them, is refused with one line naming what differs: a
    resumed job never mixes what it made before with what it would make now."""
    path = Path(path)
    stamp = path.with_name(path.name + ".inputs.json")
    if not path.exists():
        return False
    if not stamp.is_file():
        raise Eagle3Error(
            f"{what} {path} exists with no record of what it was made from ({stamp.name}): "
            "move it away, or choose another output directory"
        )
    have = json.loads(stamp.read_text())
    if have != inputs:
        raise Eagle3Error(
            f"{what} {path} was made from other inputs ({', '.join(differing_keys(have, inputs))} "
            "differ): move it away to remake it, or choose another output directory"
        )
    return True


def record_inputs(path: str | os.PathLike, inputs: dict) -> None:
    """Writes `<path>.inputs.json` once `path` is complete (see `made_from`)."""
    path = Path(path)
    write_text_atomic(
        path.with_name(path.name + ".inputs.json"), json.dumps(inputs, indent=1) + "\n"
    )
