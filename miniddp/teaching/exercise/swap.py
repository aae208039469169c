"""The learner's names in place of miniddp's, in this process and every process it starts.

``use("<name>=<file>")`` loads ``file`` as the exercise's module (relative imports resolve as in
the reference, names the file leaves out stay the reference's) and puts each of the exercise's
names it defines wherever miniddp, or a test module of its spec, holds the reference object;
``use("")`` puts the reference back. Nothing swaps at ``import miniddp``: the check's pytest plugin
(``report.py``) calls ``use`` before each case and makes the harness's ranks, forked or spawned, call it
first (``run_rank_as``), so one pytest session can check several implementations one after another.
``use`` also sets ``MINIDDP_EXERCISE=<name>=<file>`` for the processes this one starts; one started
another way (a torchrun worker) runs the reference unless its entry point calls ``apply_from_env()``
(no spec item starts one today). ``read_source`` and ``defined_names`` look at a file without
running it: the ``check`` and ``list`` process never executes a line of the learner's (``bounds.py``).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import io
import os
import sys
import tokenize
import types
from pathlib import Path

from . import integrity

ENV = "MINIDDP_EXERCISE"
_TESTS = str(Path(__file__).resolve().parents[3] / "tests") + os.sep  # the spec's own modules hold names too
_loaded: dict[str, types.ModuleType] = {}  # "<name>=<file>" -> the learner's module, loaded once per process
_current: tuple[str, list] = ("", [])  # the implementation in force, and its (reference, learner's) pairs


class LearnerFileError(ValueError):
    """The learner's file cannot stand in for the reference: one line naming the file and the name."""


def read_source(path) -> str:
    """The file's text, decoded as Python decodes it (UTF-8, or its ``coding:`` line) and compiled, never
    run; a LearnerFileError naming the file and the line for what stops it: unreadable, not text in its
    encoding, a syntax error."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise LearnerFileError(f"{path}: cannot read it ({err.strerror})") from None
    try:
        try:
            encoding = tokenize.detect_encoding(io.BytesIO(data).readline)[0]
        except SyntaxError as err:  # a first line that is not UTF-8 (said below), or an unknown coding line
            data.decode("utf-8")
            raise LearnerFileError(f"{path}: {err.msg}") from None
        source = data.decode(encoding)
        compile(source, str(path), "exec", dont_inherit=True)
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise LearnerFileError(f"{path}:{line}: byte {data[err.start]:#04x} is not {err.encoding} text: save "
                               "the file as UTF-8 (or name its encoding in a first line `# -*- coding: NAME -*-`)"
                               ) from None
    except SyntaxError as err:  # a null byte has no line
        raise LearnerFileError(f"{path}{f':{err.lineno}' if err.lineno else ''}: syntax error: {err.msg}") from None
    return source


def defined_names(source: str) -> set[str]:
    """The names the module's top level defines (def, class, assignment), read from its syntax tree."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def missing(path, required, names) -> None:
    """A LearnerFileError for the first of ``required`` not in ``names``."""
    for name in required:
        if name not in names:
            raise LearnerFileError(f"{path} defines no {name}: the exercise asks for {name} "
                                   f"(its signature is in the file `miniddp exercise start` wrote)")


def load(path: str, module_name: str, required=()) -> types.ModuleType:
    """``path`` as a sibling of ``module_name`` whose globals start as the reference's. It runs the file:
    only ever in the check's own session (``report.py``) and its ranks, never in the CLI's process."""
    read_source(path)
    reference = importlib.import_module(module_name)
    package, _, leaf = module_name.rpartition(".")
    tag = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:8]  # one module per file, in every process
    spec = importlib.util.spec_from_file_location(f"{package}._learner_{leaf}_{tag}", path)
    if spec is None:
        raise LearnerFileError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update({k: v for k, v in vars(reference).items() if not k.startswith("__")})
    sys.modules[spec.name] = module
    integrity.seal()  # what the spec compares with, recorded before the first learner's line runs here
    try:
        spec.loader.exec_module(module)
        integrity.check("importing it")
    except integrity.ComparisonReplacedError as err:
        del sys.modules[spec.name]
        raise LearnerFileError(f"{path}: {err}") from None
    except (Exception, SystemExit) as err:  # the learner's module-level code: their error, said in one line
        del sys.modules[spec.name]
        integrity.restore()  # whatever it replaced before it failed: the next file is checked as the first
        if isinstance(err, SystemExit):
            raise LearnerFileError(f"{path}: importing it called sys.exit({err.code!r}): module-level code runs "
                                   "when the check imports the file; keep it in functions") from None
        raise LearnerFileError(f"{path}: importing it raised {type(err).__name__}: {err}") from None
    missing(path, required, {k for k, v in vars(module).items() if getattr(v, "__module__", None) == spec.name})
    return module


def preload(value: str) -> None:
    """Load ``"<name>=<file>"`` now, checking the exercise's required names, for ``use`` to find."""
    from .catalog import exercise

    name, _, path = value.partition("=")
    if value not in _loaded:
        chosen = exercise(name)
        _loaded[value] = load(path, chosen.module, chosen.required)


def _holders():
    for module in list(sys.modules.values()):
        name, file = getattr(module, "__name__", ""), getattr(module, "__file__", None) or ""
        # a learner's module is never a holder, even one kept under tests/ (its own globals are its own)
        if "._learner_" not in name and (name.startswith("miniddp") or file.startswith(_TESTS)):
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
    """For the entry point of a process started fresh: ``use`` what ``MINIDDP_EXERCISE`` names (the
    reference when it is unset). Explicit: importing miniddp never calls it."""
    use(os.environ.get(ENV, ""))


def run_rank_as(value: str, rank, world_size, fn, *args):
    """A harness rank under implementation ``value``: its forkserver may have imported another one. What
    the spec compares with is checked after ``fn``, before the rank sends its result (``integrity.py``)."""
    from ...launching.rank_process import run_rank

    use(value)
    return run_rank(rank, world_size, integrity.verified(fn), *args)
