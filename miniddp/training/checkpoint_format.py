"""One checkpoint's file format: written atomically, verified by its manifest, loaded without pickles.

What
    ``save_checkpoint`` writes ``checkpoint-<step>/``: rank 0's files (model, optimizer, scheduler,
    grad scaler, trainer state), each rank's own ``rank_<rank>.pt`` (its RNG streams and the loss
    it has not yet reported), and last a ``manifest.json`` of every file's size and SHA-256. It
    writes into a temporary directory and renames it into place, so a crash mid-save leaves no
    half-written checkpoint under the real name. ``load_checkpoint`` refuses a checkpoint whose
    manifest is missing or does not match, and loads with ``torch.load(weights_only=True)``;
    ``load_checkpoint_on_every_rank`` makes one rank's failure every rank's error. Which
    checkpoints exist, and which to keep, is ``checkpoint_timeline.py``'s.

Why
    Long jobs die: preemption, a node failure, a timeout. Resuming must give the run you would
    have had without the interruption, bit for bit on CPU, which needs more than the weights:
    optimizer moments, the LR schedule's step, every RNG, and the position in the epoch. A
    checkpoint that is only partly written, or edited since, must be refused, not half-loaded.

How Hugging Face differs
    ``Trainer._save_checkpoint`` writes the same pieces (``optimizer.pt``, ``scheduler.pt``,
    ``rng_state_<rank>.pth``, ``trainer_state.json``); recent versions also stage into a
    temporary directory. It writes no manifest: a truncated file is found when ``torch.load``
    fails, if at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from .checkpoint_timeline import MANIFEST, checkpoint_dir, checkpoints, checkpoints_before, rotate_checkpoints
from .every_rank import on_every_rank
from .output_dir import OutputDirError, atomic_save, atomic_write_text
from .resume import rng_state


class CorruptCheckpointError(RuntimeError):
    """The checkpoint is incomplete or its files do not match its manifest."""


class CheckpointNotFoundError(FileNotFoundError):
    """The path does not exist, or is a directory that holds no checkpoint."""


CHECKPOINT_ERRORS = (CheckpointNotFoundError, CorruptCheckpointError)  # what resuming raises for a bad path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --8<-- [start:save]
def save_checkpoint(output_dir, step: int, states: dict, rank: int, save_total_limit=None, rank_state=None) -> Path:
    """Every rank calls this. ``states``: name -> object for rank 0's files (model, optimizer...);
    ``rank_state``: this rank's own (saved with its RNG streams in ``rank_<rank>.pt``)."""
    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(f".{final.name}.tmp")

    def begin():
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a crashed save
        tmp.mkdir(parents=True)

    def write():
        atomic_save({"rng": rng_state(), **(rank_state or {})}, tmp / f"rank_{rank}.pt")  # each rank's own
        if rank == 0:
            for name, obj in states.items():
                atomic_save(obj, tmp / f"{name}.pt")

    def publish():
        files = sorted(p.name for p in tmp.iterdir())
        manifest = {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in files}
        atomic_write_text(tmp / MANIFEST, json.dumps({"step": step, "files": manifest}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)  # atomic on one filesystem: the checkpoint appears whole or not at all
        rotate_checkpoints(output_dir, save_total_limit)  # the timeline keeps the newest save_total_limit

    try:
        on_every_rank(begin if rank == 0 else None, f"barrier before writing checkpoint-{step}")
        on_every_rank(write, f"barrier after writing checkpoint-{step}")  # every file is written
        on_every_rank(publish if rank == 0 else None, f"barrier after publishing checkpoint-{step}")  # then read it
    except (OutputDirError, OSError):  # e.g. the disk filled up: give its space back, keep the older ones
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
# --8<-- [end:save]


# --8<-- [start:load]
def load_checkpoint(path, rank: int) -> dict:
    """Verify ``path`` against its manifest and load it (weights_only). Returns name -> object."""
    path = Path(path)
    manifest = verify_checkpoint(path)
    loaded = {}
    for name in manifest:
        if name.startswith("rank_") and name != f"rank_{rank}.pt":
            continue  # another rank's streams (a rank beyond the saved world size finds none)
        key = "rank_state" if name.startswith("rank_") else name[: -len(".pt")]
        loaded[key] = torch.load(path / name, map_location="cpu", weights_only=True)
    return loaded
# --8<-- [end:load]


def verify_checkpoint(path) -> dict:
    """``path``'s manifest (file name -> size and hash), once every file matches it; else a clear error."""
    path = Path(path)
    _check_is_checkpoint(path)
    manifest = _read_manifest(path)
    for name, want in manifest.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != want["bytes"] or _sha256(f) != want["sha256"]:
            raise CorruptCheckpointError(f"{f} is missing, truncated or modified (does not match {MANIFEST}); "
                                         "refusing to resume from a corrupt checkpoint.")
    return manifest


def _read_manifest(path: Path) -> dict:
    """The manifest's ``files``, checked for shape: a damaged manifest is a corrupt checkpoint, not a traceback."""
    where = path / MANIFEST
    try:
        manifest = json.loads(where.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:  # a directory, binary, empty or invalid JSON
        raise CorruptCheckpointError(f"{where} cannot be read as a manifest ({type(err).__name__}: "
                                     f"{getattr(err, 'strerror', None) or err}); the checkpoint is damaged: resume "
                                     "from another checkpoint-<step> directory") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files or not all(
            isinstance(n, str) and "/" not in n and isinstance(w, dict) and isinstance(w.get("bytes"), int)
            and isinstance(w.get("sha256"), str) for n, w in files.items()):
        raise CorruptCheckpointError(f"{where} is not a miniddp manifest (expected {{\"files\": {{name: {{\"bytes\", "
                                     "\"sha256\"}}}}}}); the checkpoint is damaged: resume from another "
                                     "checkpoint-<step> directory")
    return files


def _check_is_checkpoint(path: Path) -> None:
    """A clear error for every way ``path`` can fail to be a complete checkpoint."""
    if not path.is_dir():
        what = "is a file, not a checkpoint-<step> directory" if path.exists() else "does not exist"
        raise CheckpointNotFoundError(f"resume_from_checkpoint: {path} {what}")
    if (path / MANIFEST).exists():
        return
    inside = checkpoints(path)
    if inside:  # an output_dir, not one of its checkpoints
        raise CheckpointNotFoundError(f"resume_from_checkpoint: {path} holds checkpoints, not one: pass "
                                      f"{inside[-1]} (the newest), or 'latest' with output_dir {path}")
    if not any(path.glob("*.pt")):
        raise CheckpointNotFoundError(f"resume_from_checkpoint: {path} holds no checkpoint (no {MANIFEST}, "
                                      "no .pt files): pass a checkpoint-<step> directory, or 'latest'")
    raise CorruptCheckpointError(f"{path} has no {MANIFEST}: it is incomplete (a save was interrupted) or not "
                                 "a miniddp checkpoint. Resume from an earlier checkpoint-<step> directory.")


TRAINER_FILES = ("model", "optimizer", "scheduler", "trainer_state")  # what every Trainer checkpoint holds


def load_checkpoint_on_every_rank(path, rank: int, latest: bool = False) -> dict:
    """Every rank calls this. If any rank cannot load ``path``, every rank raises the first such
    rank's error, so a launcher prints it once instead of one rank failing alone. ``latest``: ``path``
    is the newest of its directory; a damaged one names the newest older checkpoint that is intact."""
    def load():
        try:
            loaded = load_checkpoint(path, rank)
        except CorruptCheckpointError as err:
            older = _newest_intact_before(Path(path)) if latest else None
            if older is None:
                raise
            raise CorruptCheckpointError(f"{err} The newest intact one is {older}: resume it with "
                                         f"--resume_from_checkpoint {older}") from None
        missing = [f"{name}.pt" for name in TRAINER_FILES if name not in loaded]
        if missing or not isinstance(loaded["trainer_state"], dict):
            what = "no " + ", ".join(missing) if missing else "trainer_state.pt is damaged"
            raise CorruptCheckpointError(f"{path} is not a whole Trainer checkpoint ({what}): resume from another "
                                         "checkpoint-<step> directory")
        return loaded
    return on_every_rank(load, f"loading {path}", errors=CHECKPOINT_ERRORS)


def _newest_intact_before(path: Path) -> Path | None:
    for older in checkpoints_before(path):
        try:
            verify_checkpoint(older)
            return older
        except CHECKPOINT_ERRORS:
            continue
    return None


def load_states(path, *pairs) -> None:
    """``obj.load_state_dict(state)`` for each ``(obj, state)``: one that does not fit is a corrupt
    checkpoint, named, not a traceback (a wrong-shape model.pt behind a regenerated manifest)."""
    for obj, state in pairs:
        try:
            obj.load_state_dict(state)
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CorruptCheckpointError(f"{path}: the saved {type(obj).__name__} state does not fit this run's "
                                         f"({first[:300]}); resume from another checkpoint-<step> directory") from None
