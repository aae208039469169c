"""The ``miniddp`` console script: ``launch``, ``config``, ``env`` (training) and ``exercise`` (learning)."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["exercise"]:
        from .exercise.cli import main as exercise

        return exercise(argv[1:])
    if argv[:1] == ["config"]:
        from .training.config_command import main as config

        return config(argv[1:])
    if argv[:1] == ["env"]:
        from .training.env_command import main as env

        return env(argv[1:])
    from .training.launch import main as launch

    return launch(argv)


if __name__ == "__main__":
    raise SystemExit(main())
