"""Checkpoints: atomic, verified, and exact to resume from.

What
    ``save_checkpoint`` writes ``output_dir/checkpoint-<step>/`` with the model,
    optimizer, scheduler (and grad scaler) state from rank 0, each rank's RNG
    states, the trainer's position in the data, and last a ``manifest.json`` of
    every file's size and SHA-256. It writes into a temporary directory and
    renames it into place, so a crash mid-save leaves the previous checkpoint
    intact and never a half-written one under the real name. ``load_checkpoint``
    refuses a checkpoint whose manifest is missing or does not match, and loads
    every file with ``torch.load(weights_only=True)`` (no arbitrary pickles);
    ``load_checkpoint_on_every_rank`` makes one rank's failure every rank's error.

Why
    Long jobs die: preemption, a node failure, a timeout. Resuming must give the
    run you would have had without the interruption — same parameters, bit for
    bit on CPU — which needs more than the weights: optimizer moments, the LR
    schedule's step, every RNG, and where in the epoch's shuffled order we were.

How Hugging Face differs
    ``Trainer._save_checkpoint`` writes the same pieces (``optimizer.pt``,
    ``scheduler.pt``, ``rng_state_<rank>.pth``, ``trainer_state.json``) and
    rotates by ``save_total_limit``; recent versions also stage into a temporary
    directory. It skips already-seen batches on resume the same way we do.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from .timeouts import naming_stalled_ranks

MANIFEST = "manifest.json"  # written last: its presence marks a complete checkpoint


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


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_of(path: Path) -> int:
    m = re.fullmatch(r"checkpoint-(\d+)", Path(path).name)
    return int(m.group(1)) if m else -1


def checkpoints(output_dir) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if step_of(p) >= 0 and (p / MANIFEST).exists()]
    return sorted(found, key=step_of)


# --8<-- [start:save]
def save_checkpoint(output_dir, step: int, states: dict, rank: int, save_total_limit=None) -> Path:
    """Every rank calls this. ``states``: name -> object for rank 0's files (model, optimizer...)."""
    output_dir = Path(output_dir)
    final, tmp = output_dir / f"checkpoint-{step}", output_dir / f".checkpoint-{step}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a crashed save
        tmp.mkdir(parents=True)
    _barrier(f"barrier before writing checkpoint-{step}")
    torch.save(rng_state(), tmp / f"rng_state_{rank}.pt")  # each rank's own random streams
    if rank == 0:
        for name, obj in states.items():
            torch.save(obj, tmp / f"{name}.pt")
    _barrier(f"barrier after writing checkpoint-{step}")  # every file is written
    if rank == 0:
        files = sorted(p.name for p in tmp.iterdir())
        manifest = {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in files}
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)  # atomic on one filesystem: the checkpoint appears whole or not at all
        if save_total_limit:
            for old in checkpoints(output_dir)[:-save_total_limit]:
                shutil.rmtree(old)
    _barrier(f"barrier after publishing checkpoint-{step}")  # nobody reads it before it is whole
    return final
# --8<-- [end:save]


def _barrier(what: str) -> None:
    """A barrier whose timeout names the rank still writing (a slow disk) instead of "Timed out"."""
    with naming_stalled_ranks(what):
        dist.barrier()


# --8<-- [start:load]
def load_checkpoint(path, rank: int) -> dict:
    """Verify ``path`` against its manifest and load it (weights_only). Returns name -> object."""
    path = Path(path)
    _check_is_checkpoint(path)
    manifest = json.loads((path / MANIFEST).read_text())["files"]
    for name, want in manifest.items():
        f = path / name
        if not f.exists() or f.stat().st_size != want["bytes"] or _sha256(f) != want["sha256"]:
            raise CorruptCheckpointError(f"{f} is missing, truncated or modified (does not match {MANIFEST}); "
                                         "refusing to resume from a corrupt checkpoint.")
    loaded = {}
    for name in manifest:
        if name.startswith("rng_state_") and name != f"rng_state_{rank}.pt":
            continue
        key = "rng_state" if name.startswith("rng_state_") else name[: -len(".pt")]
        loaded[key] = torch.load(path / name, map_location="cpu", weights_only=True)
    return loaded
# --8<-- [end:load]


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


def load_checkpoint_on_every_rank(path, rank: int) -> dict:
    """Every rank calls this. If any rank cannot load ``path``, every rank raises the first such
    rank's error (one all-gather), so a launcher prints it once instead of one rank failing alone."""
    try:
        loaded, problem = load_checkpoint(path, rank), None
    except CHECKPOINT_ERRORS as err:
        loaded, problem = None, err
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, None if problem is None else (type(problem).__name__, str(problem)))
    first = next((r for r, p in enumerate(problems) if p is not None), None)
    if first is None:
        return loaded
    if first == rank:
        raise problem
    kind, message = problems[first]
    raise {e.__name__: e for e in CHECKPOINT_ERRORS}[kind](f"rank {first}: {message}")
