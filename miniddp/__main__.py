"""The ``miniddp`` console script: ``launch``, ``config``, ``env`` (launching) and ``exercise`` (teaching);
also ``python -m miniddp``."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["exercise"]:
        from .teaching.exercise.exercise_command import main as exercise

        return exercise(argv[1:])
    if argv[:1] == ["config"]:
        from .launching.config_command import main as config

        return config(argv[1:])
    if argv[:1] == ["env"]:
        from .launching.env_command import main as env

        return env(argv[1:])
    from .launching.launch import main as launch

    return launch(argv)


if __name__ == "__main__":
    raise SystemExit(main())
