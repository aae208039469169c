"""``python -m miniddp.train``: the training CLI at the name torchrun users type (``training/cli.py``)."""

from .training.cli import cli, main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    cli()
