"""The training CLI: ``torchrun --nproc-per-node N -m miniddp.train --output_dir DIR [flags]``.

    # 2 processes on this machine's CPU (gloo), the built-in classification task
    torchrun --standalone --nproc-per-node 2 -m miniddp.train --output_dir out
    # same effective batch (32) as 1 process x 32, or 2 x 4 x accumulation 4
    torchrun --standalone --nproc-per-node 2 -m miniddp.train --output_dir out \
        --per_device_train_batch_size 4 --gradient_accumulation_steps 4
    # two machines: run on each, with its own --node-rank
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 \
        --master-port 29500 -m miniddp.train --output_dir out --ddp_backend nccl
    # also installed as a console script
    miniddp-train --output_dir out      # one process, no launcher needed

Flags are the ``TrainingConfig`` fields, with Hugging Face's names. A bad flag
or value exits with status 2 and one line naming it, before any process group
exists (so N ranks do not each print a traceback). Writes
``DIR/metrics.json``, ``DIR/final_model.pt`` and ``DIR/checkpoint-<step>/``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

from .config import TrainingConfig

_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _bool(text: str) -> bool:
    if text.lower() not in _BOOL:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return _BOOL[text.lower()]


def _optional(kind):
    def parse(text: str):
        return None if text.lower() == "none" else kind(text)
    parse.__name__ = kind.__name__
    return parse


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message; one line is enough
        raise SystemExit(_fail(message))


def _fail(message: str) -> int:
    if os.environ.get("RANK", "0") == "0":  # under torchrun, only rank 0 speaks
        print(f"miniddp-train: error: {message}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="miniddp-train", description="Train a built-in task with miniddp's DDP.")
    types = {"int": int, "float": float, "str": str, "bool": _bool}
    for f in fields(TrainingConfig):
        annotation = str(f.type)
        base = next(t for name, t in types.items() if name in annotation)
        kind = _optional(base) if "None" in annotation else base
        parser.add_argument(f"--{f.name}", type=kind, default=f.default, metavar=base.__name__.upper(),
                            help=f"(default: {f.default})")
    return parser


def parse_config(argv=None) -> TrainingConfig:
    args = build_parser().parse_args(argv)
    try:
        return TrainingConfig(**vars(args))
    except (ValueError, TypeError) as err:
        raise SystemExit(_fail(f"--{str(err).split('=')[0].split()[0]}: {err}")) from None


def main(argv=None) -> dict:
    config = parse_config(argv)
    from .tasks import make_task  # torch-heavy imports after the flags are known to be good
    from .trainer import Trainer

    model, train_data, eval_data, kind = make_task(config.model, config.dataset_size, config.eval_size, config.seed,
                                                   config.dropout, config.gradient_checkpointing)
    trainer = Trainer(model, train_data, config, eval_dataset=eval_data, kind=kind)
    metrics = trainer.train()
    if trainer.rank == 0:
        shown = {k: v for k, v in metrics.items() if k != "log_history"}
        print("final: " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()))
    import torch.distributed as dist

    dist.destroy_process_group()
    return metrics


def cli() -> None:
    """Console-script entry point: ``main()``, then leave without interpreter teardown.

    torch 2.13 workers that imported ``torch._dynamo`` (``torch.optim`` does) sometimes abort
    at interpreter exit under torchrun ("terminate called without an active exception",
    SIGABRT, about 1 run in 5 here) although the process group was destroyed. Everything is
    written and flushed by then, so we exit the way multiprocessing's workers do.
    """
    main()
    exit_now(0)


def exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    cli()
