"""The learner's names in place of miniddp's, in this process and every process it starts.

``use("<name>=<file>")`` loads ``file`` as the exercise's module (relative imports resolve as in
the reference, names the file leaves out stay the reference's) and puts each of the exercise's
names it defines wherever miniddp, or a test module of its spec, holds the reference object;
``use("")`` puts the reference back. ``MINIDDP_EXERCISE=<name>=<file>`` in the environment does
the same at ``import miniddp``, so spawned ranks and torchrun workers inherit it; the harness's
forked ranks call ``use`` themselves (``run_rank_as``), so one pytest session can check several
implementations one after another.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

ENV = "MINIDDP_EXERCISE"
_TESTS = str(Path(__file__).resolve().parents[2] / "tests") + os.sep  # the spec's own modules hold names too
_loaded: dict[str, types.ModuleType] = {}  # "<name>=<file>" -> the learner's module, loaded once per process
_current: tuple[str, list] = ("", [])  # the implementation in force, and its (reference, learner's) pairs


class LearnerFileError(ValueError):
    """The learner's file cannot stand in for the reference: one line naming the file and the name."""


def load(path: str, module_name: str, required=()) -> types.ModuleType:
    """``path`` as a sibling of ``module_name`` whose globals start as the reference's."""
    reference = importlib.import_module(module_name)
    package, _, leaf = module_name.rpartition(".")
    tag = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:8]  # one module per file, in every process
    spec = importlib.util.spec_from_file_location(f"{package}._learner_{leaf}_{tag}", path)
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


def _holders():
    for module in list(sys.modules.values()):
        name, file = getattr(module, "__name__", ""), getattr(module, "__file__", None) or ""
        if (name.startswith("miniddp") and "._learner_" not in name) or file.startswith(_TESTS):
            yield module


def _pairs(module_name: str, names, learner: types.ModuleType) -> list[tuple]:
    """(reference object, learner's object) for each of ``names`` the learner's file defines itself."""
    reference = sys.modules[module_name]
    pairs = []
    for name in names:
        mine, theirs = getattr(learner, name, None), getattr(reference, name, None)
        if mine is not None and mine is not theirs and getattr(mine, "__module__", None) == learner.__name__:
            pairs.append((theirs, mine))  # a name left out stays the reference's
    return pairs


def _replace(pairs) -> None:
    """Wherever a holder holds ``old`` (by identity), put ``new``."""
    swap = {id(old): (old, new) for old, new in pairs}
    for holder in _holders():
        for attr, value in list(vars(holder).items()):
            old, new = swap.get(id(value), (None, None))
            if old is value:
                setattr(holder, attr, new)


def use(value: str) -> None:
    """Make ``value`` (``"<name>=<file>"``, or ``""`` for the reference) the implementation in force.

    Undoing sweeps every holder, not only those the swap touched: a module imported since (a test
    module a forked rank unpickles its function from) may hold the learner's objects too."""
    global _current
    if value == _current[0]:
        return
    _replace([(mine, theirs) for theirs, mine in _current[1]])
    _current = ("", [])
    os.environ.pop(ENV, None)
    if value:
        from .catalog import exercise

        name, _, path = value.partition("=")
        chosen = exercise(name)
        if value not in _loaded:
            _loaded[value] = load(path, chosen.module)
        _current = (value, _pairs(chosen.module, chosen.names, _loaded[value]))
        _replace(_current[1])
        os.environ[ENV] = value  # for the processes this one starts


def current() -> str:
    """The implementation in force: ``"<name>=<file>"``, or ``""`` for the reference. A spec test that
    computes once for several items keys its cache on it, so each implementation is run, not reused."""
    return _current[0]


def apply_from_env() -> None:
    """Called at the end of ``import miniddp`` when ``MINIDDP_EXERCISE`` is set."""
    use(os.environ[ENV])


def run_rank_as(value: str, *args):
    """A harness rank under implementation ``value``: its forkserver may have imported another one."""
    from ..rank_process import run_rank

    use(value)
    return run_rank(*args)
