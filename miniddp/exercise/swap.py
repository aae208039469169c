"""The learner's names in place of miniddp's, in this process and every process it starts.

``MINIDDP_EXERCISE=<name>=<file>`` in the environment makes ``import miniddp`` load ``file`` as
the exercise's module (relative imports resolve as in the reference, names the file leaves
out stay the reference's) and put each of the exercise's names it defines wherever miniddp
holds the reference object. The forkserver of the test harness, forked ranks, spawned ranks and
torchrun workers all import miniddp, so the swap holds in all of them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

ENV = "MINIDDP_EXERCISE"


class LearnerFileError(ValueError):
    """The learner's file cannot stand in for the reference: one line naming the file and the name."""


def load(path: str, module_name: str, required=()) -> types.ModuleType:
    """``path`` as a sibling of ``module_name`` whose globals start as the reference's."""
    reference = importlib.import_module(module_name)
    package, _, leaf = module_name.rpartition(".")
    spec = importlib.util.spec_from_file_location(f"{package}._learner_{leaf}", path)
    if spec is None:
        raise LearnerFileError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update({k: v for k, v in vars(reference).items() if not k.startswith("__")})
    try:
        source = open(path, encoding="utf-8").read()
        compile(source, path, "exec")
    except OSError as err:
        raise LearnerFileError(f"{path}: cannot read it ({err.strerror})") from None
    except SyntaxError as err:
        raise LearnerFileError(f"{path}:{err.lineno}: syntax error: {err.msg}") from None
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the learner's module-level code: their error, said in one line
        del sys.modules[spec.name]
        raise LearnerFileError(f"{path}: importing it raised {type(err).__name__}: {err}") from None
    defined = {k for k, v in vars(module).items() if getattr(v, "__module__", None) == spec.name}
    for name in required:
        if name not in defined:
            raise LearnerFileError(f"{path} defines no {name}: the exercise asks for {name} "
                                   f"(its signature is in the file `miniddp exercise start` wrote)")
    return module


def apply(module_name: str, names, learner: types.ModuleType) -> list[str]:
    """Put ``learner``'s own definitions of ``names`` wherever miniddp holds the reference's; what moved."""
    reference = sys.modules[module_name]
    moved = []
    for name in names:
        mine, theirs = getattr(learner, name, None), getattr(reference, name, None)
        if mine is None or mine is theirs or getattr(mine, "__module__", None) != learner.__name__:
            continue  # left out: the reference's stays
        for holder in list(sys.modules.values()):
            if holder is learner or not getattr(holder, "__name__", "").startswith("miniddp"):
                continue
            for attr, value in list(vars(holder).items()):
                if value is theirs:
                    setattr(holder, attr, mine)
        moved.append(name)
    return moved


def apply_from_env() -> None:
    """Called at the end of ``import miniddp`` when ``MINIDDP_EXERCISE`` is set."""
    from .catalog import exercise

    name, _, path = os.environ[ENV].partition("=")
    chosen = exercise(name)
    apply(chosen.module, chosen.names, load(path, chosen.module))
