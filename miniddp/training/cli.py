"""The training CLI: ``torchrun --nproc-per-node N -m miniddp.train --output_dir DIR [flags]``.

What
    The flags are the ``TrainingConfig`` fields, with Hugging Face's names; ``--help`` describes
    each from the field's ``metadata["help"]`` in ``config.py``. It trains a built-in task
    (``tasks.py``) and writes ``DIR/metrics.json``, ``DIR/final_model.pt`` and
    ``DIR/checkpoint-<step>/``. Exit status: 0 done; 2 a bad flag or value (before any process
    group exists); 3 the job could not start (a backend this machine cannot run, a bad
    ``--resume_from_checkpoint``...); 4 training diverged; 5 a peer was lost. For instance:

        torchrun --standalone --nproc-per-node 2 -m miniddp.train --output_dir out   # 2 CPU processes
        torchrun --standalone --nproc-per-node 2 -m miniddp.train --output_dir out \\
            --per_device_train_batch_size 4 --gradient_accumulation_steps 4   # effective batch 32
        torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 \\
            --master-port 29500 -m miniddp.train --output_dir out --ddp_backend nccl   # each machine
        miniddp-train --output_dir out      # the console script: one process, no launcher needed

Why
    One command that runs anywhere with no download, to try every flag of the page. An error is
    one line, printed once by rank 0, and also written to torchrun's error file, so torchrun's
    failure summary shows the same line (torchrun itself then exits 1).

How Hugging Face differs
    Transformers' example scripts build their flags from ``TrainingArguments`` with
    ``HfArgumentParser``, from the same dataclass fields and ``metadata["help"]``. Here a misspelt
    flag gets a suggestion, flags are never abbreviated, and each kind of failure has its exit status.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
import time
from dataclasses import fields

from .config import TrainingConfig, choices, field_help

BAD_FLAG, CANNOT_START, DIVERGED, PEER_LOST = 2, 3, 4, 5  # exit statuses
RANK_0_FIRST_S = 5.0  # how long other ranks wait before exiting on an error rank 0 reports
_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}

EPILOG = """\
launch on several processes with torchrun:
  torchrun --standalone --nproc-per-node 2 -m miniddp.train --output_dir out
  torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 \\
      --master-port 29500 -m miniddp.train --output_dir out --ddp_backend nccl
exit status: 0 done, 2 bad flag or value, 3 the job could not start (or could not write),
  4 training diverged (NaN or inf loss: nothing written after the last checkpoint),
  5 a peer stalled, died or became unreachable (each rank says which, from where it stands)"""


def _bool(text: str) -> bool:
    if text.lower() not in _BOOL:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return _BOOL[text.lower()]


def _optional(kind):
    def parse(text: str):
        return None if text.lower() == "none" else kind(text)
    parse.__name__ = kind.__name__
    return parse


def _number_or_word(text: str):
    """A ``float | str | None`` field (``--ddp_bucket_cap_mb 25``, ``auto`` or ``none``): the config names bad words."""
    if text.lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        return text


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message; one line is enough
        for flag in re.findall(r"(?<!\S)(--?[\w-]+)", message.partition("unrecognized arguments:")[2]):
            close = difflib.get_close_matches(flag, self._option_string_actions, n=1)
            if close:
                message += f" (did you mean {close[0]}?)"
        raise SystemExit(fail(message, BAD_FLAG))


def fail(message: str, status: int, every_rank: bool = False) -> int:
    """Say ``message`` once (rank 0) and in torchrun's error file (every rank); return ``status``.

    Under torchrun the other ranks wait a little before exiting: torchrun stops every worker
    as soon as one exits, and rank 0 must not be stopped before it speaks (when only some
    other rank failed, torchrun's summary still shows the line, from that rank's error file).
    """
    line = " ".join(str(message).split())  # one line, whatever the exception's text looked like
    if every_rank:  # each rank's own view (which peer it lost): every rank speaks, at once
        print(f"miniddp-train: error: rank {os.environ.get('RANK', '0')}: {line}", file=sys.stderr, flush=True)
    elif os.environ.get("RANK", "0") == "0":  # under torchrun, only rank 0 speaks
        print(f"miniddp-train: error: {line}", file=sys.stderr, flush=True)
    else:
        time.sleep(RANK_0_FIRST_S)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # set by torchrun for each worker
    if error_file:  # its failure summary shows this line instead of a link to its docs
        with open(error_file, "w") as f:  # the format of torch.distributed.elastic's ErrorHandler
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": f"miniddp-train: {line}",
                                                                  "timestamp": str(int(time.time()))}}}, f)
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="miniddp-train", description="Train a built-in task with miniddp's DDP.",
                            epilog=EPILOG, allow_abbrev=False,  # --learning_rat is a typo, not a prefix
                            formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(
                                prog, max_help_position=40))
    helps, named = field_help(), choices()
    types = {"int": int, "float": float, "str": str, "bool": _bool}
    for f in fields(TrainingConfig):
        annotation = str(f.type)
        base = next(t for name, t in types.items() if name in annotation)
        kind = _optional(base) if "None" in annotation else base
        if base is float and "str" in annotation:
            kind = _number_or_word
        metavar = "{true,false}" if base is _bool else base.__name__.upper()
        parser.add_argument(f"--{f.name}", type=kind, default=f.default, choices=named.get(f.name),
                            metavar=None if f.name in named else metavar,
                            help=f"{helps[f.name]} (default: {f.default})")
    return parser


def parse_config(argv=None) -> TrainingConfig:
    args = build_parser().parse_args(argv)
    try:
        return TrainingConfig(**vars(args))
    except (ValueError, TypeError) as err:  # the config's errors start with the field's name
        name = re.match(r"\w*", str(err)).group()
        raise SystemExit(fail(f"--{name}: {err}" if name in TrainingConfig.field_names() else err, BAD_FLAG)) from None


def backend_not_installed(err: Exception, config: TrainingConfig) -> str | None:
    """The line for a registered ``torch.compile`` backend whose package is missing (``tvm``, ``openxla``):
    torch says so only when the first forward compiles, the same on every rank. None for any other error."""
    if not config.torch_compile:
        return None
    from torch._dynamo.exc import BackendCompilerFailed  # noqa: PLC0415 - imported already: the model compiled

    if not (isinstance(err, BackendCompilerFailed) and isinstance(err.inner_exception, ImportError)):
        return None
    backend = config.torch_compile_backend or "inductor"
    return f"--torch_compile_backend {backend} cannot run here: {err.inner_exception}"


def main(argv=None) -> dict:
    config = parse_config(argv)
    import torch.distributed as dist  # torch-heavy imports after the flags are known to be good

    from ..process_group.stalled_ranks import StalledRankError
    from .checkpoint_format import CHECKPOINT_ERRORS
    from .nonfinite import NonFiniteLossError
    from .output_dir import OutputDirError
    from .resume import SetupChangedError
    from .tasks import make_task
    from .trainer import Trainer

    try:
        trainer = Trainer(args=config, **make_task(config))  # backend, device, rendezvous, the DDP wrap
    except (ValueError, RuntimeError) as err:
        raise SystemExit(fail(err, CANNOT_START)) from None
    try:
        metrics = trainer.train()
    except (*CHECKPOINT_ERRORS, SetupChangedError, OutputDirError) as err:  # the same error on every rank
        raise SystemExit(fail(err, CANNOT_START)) from None
    except NonFiniteLossError as err:
        raise SystemExit(fail(err, DIVERGED)) from None
    except StalledRankError as err:  # a peer stalled, died or is cut off: named by naming_stalled_ranks
        raise SystemExit(fail(err, PEER_LOST, every_rank=True)) from None
    except Exception as err:
        missing = backend_not_installed(err, config)
        if missing is None:
            raise
        raise SystemExit(fail(missing, CANNOT_START)) from None
    if trainer.rank == 0:
        shown = {k: v for k, v in metrics.items() if k != "log_history"}
        print("final: " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()))
        out = config.output_dir
        print(f"results: {os.path.join(out, 'metrics.json')}, {os.path.join(out, 'final_model.pt')}")
    dist.destroy_process_group()
    return metrics


def cli() -> None:
    """Console-script entry point: ``main()``, whose ``SystemExit`` carries the exit status.

    The interpreter's teardown is safe: the group is destroyed and nothing holds it (see
    ``clean_exit``), so the run ends as any script does, atexit functions included."""
    main()


if __name__ == "__main__":
    cli()
