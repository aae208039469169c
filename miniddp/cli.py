"""The ``miniddp`` console script: ``miniddp launch ...`` (training) and ``miniddp exercise ...`` (learning)."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["exercise"]:
        from .exercise.cli import main as exercise

        return exercise(argv[1:])
    from .training.launch import main as launch

    return launch(argv)


if __name__ == "__main__":
    raise SystemExit(main())
