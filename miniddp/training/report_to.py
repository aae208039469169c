"""Where the logs go besides ``log_history``: ``report_to``, as in ``TrainingArguments``.

What
    ``report_to="none"`` (the default) keeps the logs in ``log_history`` and ``metrics.json``.
    ``report_to="tensorboard"``: rank 0 also writes each ``log_history`` entry as TensorBoard
    scalars (``train/loss``, ``train/learning_rate``; at the end ``train/train_loss`` and the
    ``eval/...`` metrics), flushed at each logging step, into ``$TENSORBOARD_LOGGING_DIR`` or
    ``output_dir/runs/<date>_<host>``. ``check_report_to`` refuses the name, with the missing
    package named, before any rank starts; the directory, named when the ``Reporter`` is made
    (``Reporter.logging_dir``), is checked with ``output_dir`` before the first step
    (``output_dir.claim_output_dir``).

Why
    The numbers are already averaged over ranks when they are logged, so one writer is enough;
    eight ranks writing eight event files of the same curve would be eight curves in TensorBoard.
    A missing package or an unwritable directory found at the first logging step would cost a
    job's start-up, and end it in a traceback.

How Hugging Face differs
    ``transformers.integrations.TensorBoardCallback`` writes the same tags from the main process,
    to the same default directory, and also records the arguments and the model config as text.
    Transformers knows a dozen more integrations (``wandb``, ``mlflow``, ...) and ``"all"``; here
    only these two names exist, and a list is not accepted.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from datetime import datetime

REPORT_TO = ("none", "tensorboard")


def check_report_to(report_to: str) -> None:
    """A ValueError naming the field and the fix, for an unknown name or a missing package."""
    if report_to not in REPORT_TO:
        raise ValueError(f"report_to={report_to!r} must be one of {', '.join(REPORT_TO)}")
    if report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("report_to='tensorboard' needs the tensorboard package, which is not installed: "
                         "pip install tensorboard (or report_to='none')")


def logging_dir(output_dir: str) -> str:
    """Transformers' default: $TENSORBOARD_LOGGING_DIR, else output_dir/runs/<date>_<host>."""
    chosen = os.environ.get("TENSORBOARD_LOGGING_DIR")
    if chosen:
        return os.path.expanduser(chosen)
    return os.path.join(output_dir, "runs", f"{datetime.now():%b%d_%H-%M-%S}_{socket.gethostname()}")


def tag(key: str) -> str:
    """``eval_loss`` -> ``eval/loss``; ``lr`` -> ``train/learning_rate``; anything else -> ``train/<key>``."""
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_"):]
    return "train/" + {"lr": "learning_rate"}.get(key, key)


class Reporter:
    """``report_to`` for one rank: only rank 0 with ``tensorboard`` writes; the writer opens at the first log."""

    def __init__(self, report_to: str, output_dir: str, rank: int):
        self.enabled = report_to == "tensorboard" and rank == 0
        self.logging_dir = logging_dir(output_dir) if self.enabled else None  # checked with output_dir
        self.writer = None  # opened lazily: output_dir is claimed (and maybe cleaned) before the first step

    def log(self, values: dict, step: int) -> None:
        """Numbers in ``values`` become scalars at ``step``; ``step`` itself and other types are skipped."""
        if not self.enabled:
            return
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - tensorboard only when asked

            self.writer = SummaryWriter(log_dir=self.logging_dir)
        for key, value in values.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag(key), value, step)
        self.writer.flush()  # readable while training runs

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
