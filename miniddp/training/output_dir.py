"""The output directory: owned by one run, checked before the first step, written atomically.

What
    ``claim_output_dir`` runs on rank 0 when a ``Trainer`` is built. It takes the
    directory's lock (``.miniddp.lock``, an ``fcntl.flock`` held until the run
    ends), refuses a directory that holds another run's results unless the run
    resumes from it or ``overwrite_output_dir`` is set (which deletes them), removes
    the debris of interrupted saves, and checks that the directory is writable and
    has room for a checkpoint, and that ``report_to``'s log directory can be made
    (``check_can_create``: made, then removed again). ``atomic_save`` /
    ``atomic_write_text`` write a file as temp file, fsync, rename, fsync of the
    directory: a reader sees the old version or the new one, never half of one.
    Every failure is one ``OutputDirError`` line naming the path and the cause.

Why
    Two runs started into the same directory both "succeed" while one's
    checkpoints overwrite the other's; rotation by step number then deletes the
    new run's checkpoints and keeps the old one's, so ``latest`` resumes the wrong
    run. Unchecked, an unusable directory is found after hours of training, and a
    full disk replaces a good ``final_model.pt`` with half of a new one. The
    lock is a kernel lock: it disappears with its process, even after ``kill -9``,
    so a dead run never blocks the next one (the next one names who held it).

How Hugging Face differs
    ``TrainingArguments.overwrite_output_dir`` only silences a check in some
    example scripts; the ``Trainer`` itself writes into any directory, locks
    nothing, and ``torch.save``s ``pytorch_model.bin`` in place. Accelerate's
    ``save_state`` neither. Writing through a temp file and ``os.replace`` is the
    standard POSIX recipe (``rename(2)`` is atomic within one filesystem).
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import re
import shutil
import socket
import stat
import sys
import time
from pathlib import Path

import torch

LOCK = ".miniddp.lock"  # holds {host, pid, started}; flock'ed by rank 0 for the whole run
RESULTS = ("final_model.pt", "metrics.json")  # with checkpoint-*/: what marks another run's results


class OutputDirError(RuntimeError):
    """The output directory cannot be used: locked by a live run, another run's, unwritable, or full."""


def _cause(err: OSError) -> str:
    return err.strerror or str(err) if isinstance(err, OSError) else str(err)


# --8<-- [start:atomic]
def atomic_write_bytes(path, data: bytes) -> None:
    """Write ``path`` as temp file + fsync + rename: a crash or full disk leaves the old file intact."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)  # atomic: readers see the old file or the new one
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # ... and the rename itself survives a power cut
        finally:
            os.close(directory)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OutputDirError(f"could not write {path}: {_cause(err)}"
                             + (" (the disk is full: free space or use another --output_dir)"
                                if err.errno == errno.ENOSPC else "")) from None
# --8<-- [end:atomic]


def atomic_save(obj, path) -> None:
    """``torch.save`` through ``atomic_write_bytes`` (and a real OSError, not "basic_ios::clear")."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def atomic_write_text(path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def previous_results(output_dir) -> list[str]:
    """Names in ``output_dir`` that another run left: final model, metrics, numbered checkpoints. Only
    miniddp's own names: a ``checkpoint-best/`` of the user's is neither refused nor deleted."""
    out = Path(output_dir)
    found = [name for name in RESULTS if (out / name).is_file()]
    return found + sorted((p.name for p in out.glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name)
                           and p.is_dir()), key=lambda name: int(name.split("-")[1]))


class OutputDirLock:
    """An exclusive ``flock`` on ``output_dir/.miniddp.lock`` for this process; ``release()`` ends it."""

    def __init__(self, output_dir, created_dir: bool = False):
        self.path = Path(output_dir) / LOCK
        self.created_dir = created_dir  # this run made output_dir: a run that leaves nothing else removes it
        try:  # never through a link: a .miniddp.lock pointing at another file would be truncated
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EISDIR):
                what = "symbolic link" if err.errno == errno.ELOOP else "directory"
                raise OutputDirError(f"{self.path} is a {what}, not miniddp's lock file: remove it, or choose another "
                                     "--output_dir") from None
            raise
        info = os.fstat(self.fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
            os.close(self.fd)
            what = "a hard link" if info.st_nlink > 1 else "a special file"
            raise OutputDirError(f"{self.path} is not a plain file of its own ({what}): it is miniddp's lock file and "
                                 "would be overwritten; remove it, or choose another --output_dir")
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kernel drops it when we die
        except BlockingIOError:
            holder = self._holder()
            os.close(self.fd)
            raise OutputDirError(f"{self.path.parent} is in use by another run ({holder}): wait for it to end, "
                                 "or choose another --output_dir") from None
        self.previous = self._holder()  # a dead run's lock we just took over, or "" for a fresh one
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(sys.argv)}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(me).encode(), 0)

    def _holder(self) -> str:
        try:
            who = json.loads(os.pread(self.fd, 4096, 0) or b"null")
        except ValueError:  # not JSON (binary, or half-written)
            return "unknown"
        if not who:
            return ""
        if not isinstance(who, dict):
            return "unknown"
        return f"pid {who.get('pid', '?')} on {who.get('host', '?')}, started {who.get('started', '?')}"

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # a clean end: the next run has nobody to "take over" from
            os.close(self.fd)  # closing drops the flock; the file stays (it is only a name for the lock)
            self.fd = None
            directory = self.path.parent
            if self.created_dir and [p.name for p in directory.iterdir()] == [LOCK]:  # a run that wrote nothing
                self.path.unlink(missing_ok=True)
                directory.rmdir()


def check_can_create(directory) -> None:
    """Make ``directory`` and a file in it as a writer will, then remove what this made; an OSError if it cannot."""
    path = Path(directory)
    made = [p for p in [path, *path.parents] if not p.exists()]  # deepest first: removed in this order
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".miniddp.write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    finally:
        for directory_made in made:
            try:
                directory_made.rmdir()
            except FileNotFoundError:  # never made: a parent could not be
                continue
            except OSError:  # not empty: someone else's now
                break


def _what_blocks(path: Path) -> str:
    """`` (X is a file)`` for the file in the way of a directory path, if there is one."""
    blocker = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), None)
    return f" ({blocker} is a file)" if blocker else ""


# --8<-- [start:claim]
def claim_output_dir(output_dir, *, resuming: bool, overwrite: bool, need_bytes: int,
                     logging_dir: str | None = None) -> OutputDirLock:
    """Rank 0, before the first step: lock ``output_dir``, refuse another run's results, clean, check room
    (and that ``logging_dir``, ``report_to``'s TensorBoard directory when it has one, can be written)."""
    out = Path(output_dir)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputDirError(f"--output_dir {out} cannot be created: {_cause(err)}") from None
    try:
        lock = OutputDirLock(out, created_dir=created)
    except OSError as err:  # read-only, permission, or a filesystem without locks
        raise OutputDirError(f"--output_dir {out} is not writable: {_cause(err)}") from None
    try:
        if lock.previous:
            print(f"miniddp: took over {out / LOCK} from {lock.previous}: that run is no longer running",
                  file=sys.stderr, flush=True)
        found = previous_results(out)
        if found and overwrite:
            print(f"miniddp: overwrite_output_dir: deleting {', '.join(found)} in {out}", file=sys.stderr, flush=True)
            for name in found:
                shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
        elif found and not resuming:
            raise OutputDirError(f"--output_dir {out} holds another run's results ({', '.join(found[:4])}"
                                 f"{', ...' if len(found) > 4 else ''}): resume it with --resume_from_checkpoint "
                                 "latest, replace them with --overwrite_output_dir true, or choose another directory")
        leftovers = [p for p in [*out.glob(".checkpoint-*.tmp"), *out.glob(".*.tmp-*")]  # interrupted saves: ours
                     if re.fullmatch(r"\.checkpoint-\d+\.tmp|\..+\.tmp-\d+", p.name)]
        for debris in leftovers:
            shutil.rmtree(debris) if debris.is_dir() else debris.unlink()
        atomic_write_bytes(out / ".miniddp.write-test", b"ok")  # writable, fsync works
        (out / ".miniddp.write-test").unlink()
        free = shutil.disk_usage(out).free
        if free < need_bytes:
            raise OutputDirError(f"--output_dir {out} has {free / 2**20:.1f} MiB free; a checkpoint and the final "
                                 f"model need about {need_bytes / 2**20:.1f} MiB: free space or use another directory")
        if logging_dir is not None:
            try:
                check_can_create(logging_dir)
            except OSError as err:
                raise OutputDirError(f"--report_to tensorboard: its log directory {logging_dir} cannot be written: "
                                     f"{_cause(err)}{_what_blocks(Path(logging_dir))}; set $TENSORBOARD_LOGGING_DIR "
                                     "or --output_dir to a writable directory, or --report_to none") from None
    except BaseException:
        lock.release()
        raise
    return lock
# --8<-- [end:claim]


def bytes_to_save(model: torch.nn.Module, optimizer_copies: int, checkpoints: bool) -> int:
    """About what a run writes at once: the final model, and one checkpoint (model + optimizer state)."""
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return size * (1 + (1 + optimizer_copies if checkpoints else 0)) + (1 << 20)  # + 1 MiB for small files
