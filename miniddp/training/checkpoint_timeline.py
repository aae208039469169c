"""The checkpoint directories: the ``checkpoint-<step>/`` of one output_dir, oldest first (its timeline).

What
    Names on disk, never the bytes inside (``checkpoint_format.py`` owns those). ``checkpoints`` lists the
    complete checkpoints (their ``manifest.json`` exists) by step; ``rotate_checkpoints`` keeps the
    newest ``save_total_limit``; ``checkpoints_before`` gives the older ones, newest first, for a
    resume of ``latest`` that finds the newest damaged; ``set_aside_later_results`` moves what came
    after a resumed checkpoint into ``superseded/``.

Why
    An output_dir is one run's history. Resuming an earlier checkpoint starts another timeline: the
    later checkpoints and the final results then belong to a future this run will not have. Left in
    place, rotation (which keeps the highest steps) would delete this run's fresh checkpoints and
    ``latest`` would resume the other timeline's. Setting them aside keeps both, deletes nothing.

How Hugging Face differs
    ``Trainer._sorted_checkpoints`` and ``_rotate_checkpoints`` list and rotate the same way
    (``transformers/trainer.py``; it also keeps the best model's checkpoint), and
    ``trainer_utils.get_last_checkpoint`` finds ``latest``. A resume from an earlier checkpoint
    leaves the later ones in place there.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from .output_dir import RESULTS

MANIFEST = "manifest.json"  # written last by a save: its presence marks a complete checkpoint


def checkpoint_dir(output_dir, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def step_of(path: Path) -> int:
    """The step in a ``checkpoint-<step>`` name; -1 for any other name."""
    m = re.fullmatch(r"checkpoint-(\d+)", Path(path).name)
    return int(m.group(1)) if m else -1


def checkpoints(output_dir) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if step_of(p) >= 0 and (p / MANIFEST).exists()]
    return sorted(found, key=step_of)


def checkpoints_before(path: Path) -> list[Path]:
    """The complete checkpoints of ``path``'s directory saved before it, newest first."""
    return [p for p in reversed(checkpoints(path.parent)) if step_of(p) < step_of(path)]


def rotate_checkpoints(output_dir, save_total_limit: int | None) -> None:
    """Delete all but the newest ``save_total_limit`` complete checkpoints (None or 0: keep all)."""
    if save_total_limit:
        for old in checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(old)


# --8<-- [start:set_aside]
def set_aside_later_results(output_dir, resumed) -> Path | None:
    """Rank 0, resuming ``resumed`` inside ``output_dir``: the checkpoints saved after it, and the final model
    and metrics, belong to the timeline that went on from it. Move them into ``superseded/`` (nothing is
    deleted), so that rotation, ``latest`` and "the last checkpoint" see this run's timeline only."""
    out, resumed = Path(output_dir).resolve(), Path(resumed).resolve()
    if resumed.parent != out:
        return None  # resumed from elsewhere: this output_dir has no other timeline
    later = [p for p in checkpoints(out) if step_of(p) > step_of(resumed)]
    results = [out / name for name in RESULTS if (out / name).exists()]
    if not later and not results:
        return None
    aside = out / "superseded" / f"after-{resumed.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    for n in range(2, 1000):  # two resumes within a second: a folder each
        if not aside.exists():
            break
        aside = aside.with_name(f"{aside.name.rsplit('.', 1)[0]}.{n}")
    aside.mkdir(parents=True)
    for p in later + results:
        os.replace(p, aside / p.name)
    return aside
# --8<-- [end:set_aside]
