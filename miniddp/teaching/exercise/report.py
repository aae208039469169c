"""A pytest plugin for ``miniddp exercise check``: several implementations in one bounded session.

``pytest -p miniddp.teaching.exercise.report`` with ``MINIDDP_EXERCISE_BATCH=<file>`` reads
``[{"use": "<name>=<file>", "tests": [node ids], "timeout": seconds}, ...]``. It first imports each
learner's file (checking its names), each within its timeout; then each test named there runs once
per implementation that names it and imported, with that implementation in force (``swap.use``) in
this process and in every rank it starts. pytest, torch and the ranks' forkserver start once for all.

Each test case (one parametrisation) has the implementation's timeout: the harness's calls end by
then, with each rank's stack (``testing.set_call_deadline``); a moment later an alarm raises
``CheckTimeout`` wherever the test is. Either is final: the implementation's remaining items are not
run (a hang costs one timeout per file, not one per item), and Hypothesis never sees the alarm,
which is no ``Exception``, so it does not run the example again to shrink it. After each case, what
the spec compares with must still be what it was before the learner's code ran (``integrity.py``),
or the case fails, naming what was replaced.

It appends what happens to ``MINIDDP_EXERCISE_JOURNAL``, one JSON object per line (``load``,
``loaded``, ``collected``, ``start``, ``result``, ``finish``, ``done``, ``end``), for ``bounds.py``,
which watches the session from outside and reports a step that no timeout here could stop.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time

import pytest

from . import integrity, swap
from .bounds import BATCH_ENV, JOURNAL_ENV
from .reasons import case_id, explain, shorten, where_in_process

PARAM = "exercise_implementation"
STACK_S = 3.0  # after a case's timeout, before the alarm: time for the harness to read the ranks' stacks
_batch: list[dict] = []
_index: dict[str, int] = {}  # a case's node id -> the implementation it runs under
_left: dict[tuple[int, str], int] = {}  # (implementation, test) -> its cases not finished yet
_hung: dict[int, str] = {}  # implementation -> the test whose case ran out of time: the rest is not run
_failed: set[tuple[int, str]] = set()  # its other cases are skipped: one failure says it
_case: dict = {"inside": False, "deadline": None}  # the case being timed, and whether a phase of it is running
_journal = []


class CheckTimeout(BaseException):
    """A test case (or importing a file) ran past the check's timeout. A BaseException, so neither
    Hypothesis nor a test's ``except Exception`` catches it: the case ends here, once."""


def _write(**event) -> None:
    if _journal:
        _journal[0].write(json.dumps(event) + "\n")
        _journal[0].flush()


def _alarm(signum, frame):
    if _case["inside"]:
        raise CheckTimeout()
    signal.setitimer(signal.ITIMER_REAL, 0.05)  # between two phases, in pytest's code: at the next one


def _arm(timeout: float | None) -> None:
    from ...launching import spawn as harness

    _case["deadline"] = None if timeout is None else time.monotonic() + timeout
    harness.set_call_deadline(_case["deadline"])
    signal.setitimer(signal.ITIMER_REAL, 0 if timeout is None else timeout + STACK_S)


def _hypothesis_for_learners() -> None:
    """The same examples on every check (derandomized, no database), and no "explain" phase: its notes
    speak of the test's own lines, not the learner's. A test's own ``@settings`` still set the rest."""
    from hypothesis import Phase, settings

    settings.register_profile("miniddp-exercise", derandomize=True, database=None,
                              phases=[p for p in Phase if p is not Phase.explain])
    settings.load_profile("miniddp-exercise")


def pytest_configure(config):
    path = os.environ.get(BATCH_ENV)
    if not path:
        return
    _batch[:] = json.load(open(path, encoding="utf-8"))
    _journal.append(open(os.environ[JOURNAL_ENV], "a", encoding="utf-8"))
    _hypothesis_for_learners()
    signal.signal(signal.SIGALRM, _alarm)
    for i, implementation in enumerate(_batch):  # each file's module-level code runs here, bounded, first
        _write(event="load", impl=i)
        file, timeout = implementation["use"].partition("=")[2], implementation["timeout"]
        error, _case["inside"] = None, True
        _arm(timeout)
        try:
            swap.preload(implementation["use"])
        except swap.LearnerFileError as err:
            error = str(err)
        except CheckTimeout:
            error = (f"{file}: importing it did not finish within {timeout:g} s: module-level code runs when the "
                     "check imports the file; keep it in functions")
        finally:
            _case["inside"] = False
            _arm(None)
        implementation["loaded"] = error is None
        _write(event="loaded", impl=i, error=error)


def pytest_generate_tests(metafunc):
    base = metafunc.definition.nodeid.split("[", 1)[0]
    wanted = [i for i, impl in enumerate(_batch) if impl["loaded"] and base in impl["tests"]]
    if wanted:
        metafunc.fixturenames.append(PARAM)
        metafunc.parametrize(PARAM, wanted, ids=[f"implementation{i}" for i in wanted])


def pytest_collection_modifyitems(config, items):
    if not _batch:
        return
    kept = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and PARAM in callspec.params:
            _index[item.nodeid] = index = callspec.params[PARAM]
            key = (index, item.nodeid.split("[", 1)[0])
            _left[key] = _left.get(key, 0) + 1
            kept.append(item)
    if len(kept) < len(items):  # a test no imported file is checked by (they all failed to import): not run at all
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in _index])
        items[:] = kept
    _write(event="collected", cases=[sum(n for (i, _), n in _left.items() if i == k) for k in range(len(_batch))])


@pytest.fixture(autouse=True)
def _exercise_implementation(request):
    """Autouse, so set up before the test's own fixtures: they are built under the implementation too."""
    index = _index.get(request.node.nodeid)
    if index is None:
        yield
        return
    from ...launching import spawn as harness

    base = request.node.nodeid.split("[", 1)[0]
    if index in _hung:
        pytest.skip(f"not run: {_hung[index]} ran out of time first")
    if (index, base) in _failed:
        pytest.skip("this spec item already failed for this implementation")
    value, original = _batch[index]["use"], harness.run_rank
    swap.use(value)
    harness.run_rank = functools.partial(swap.run_rank_as, value)  # a forked rank switches before it runs
    yield
    harness.run_rank = original


def _timed_phase(item):
    """A phase of a case (setup, call, teardown): the alarm may raise only inside one."""
    _case["inside"] = item.nodeid in _index
    try:
        return (yield)
    finally:
        _case["inside"] = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    index = _index.get(item.nodeid)
    if index is not None:
        _write(event="start", impl=index, test=item.nodeid.split("[", 1)[0], case=_case_id(item, index),
               timeout=_batch[index]["timeout"])
        _arm(_batch[index]["timeout"])
    return (yield from _timed_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _timed_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield from _timed_phase(item))
    finally:
        if item.nodeid in _index:
            _arm(None)
            # once the case is over (a fixture's monkeypatch undone): what the spec compared with must be
            # what it was before the learner's code ran, or the case fails; the originals are put back
            integrity.check("your code, in this test case,")


def _case_id(item, index: int) -> str:
    return case_id(item, f"implementation{index}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    index = _index.get(item.nodeid)
    if index is not None and (report.when == "call" or report.failed or report.skipped):
        base = item.nodeid.split("[", 1)[0]
        result = {"outcome": report.outcome, "case": _case_id(item, index), "reason": ""}
        if report.skipped:
            result["after"] = _hung.get(index)
        elif report.failed:
            result.update(_failure(item, call, report, index))
            if result.get("stopped"):  # a hang is final for this file: its other items are not run
                _hung.setdefault(index, base)
            _failed.add((index, base))
        _write(event="result", impl=index, test=base, **result)
    return report


def _failure(item, call, report, index: int) -> dict:
    """A failed case's reason (its case first), and whether a timeout stopped it, with the limit."""
    from miniddp.launching.spawn import RankTimeout

    exc, timeout = (call.excinfo.value if call.excinfo else None), _batch[index]["timeout"]
    case = _case_id(item, index)
    head = f"[{case}] " if case else ""
    if exc is None:  # a failure pytest made itself
        return {"reason": head + shorten(str(report.longrepr or "failed"))}
    deadline = _case["deadline"] or float("inf")  # none once the case's teardown has begun
    ours = isinstance(exc, CheckTimeout) or (isinstance(exc, RankTimeout) and time.monotonic() >= deadline)
    if ours:  # the check's own timeout: where the test was, or where each rank was
        lines = [f"{head}stopped: ran past the time limit of {timeout:g} s per test case"]
        lines += where_in_process(call.excinfo.tb) if isinstance(exc, CheckTimeout) else str(exc).splitlines()[1:]
        return {"reason": "\n".join(lines), "stopped": "time", "limit": timeout}
    lines = explain(exc)
    lines[0] = head + lines[0]
    if isinstance(exc, RankTimeout):  # the test's own multi-rank timeout: as final as ours
        return {"reason": "\n".join(lines), "stopped": "time", "limit": exc.timeout}
    return {"reason": "\n".join(lines)}


def pytest_runtest_logfinish(nodeid, location):
    index = _index.get(nodeid)
    if index is not None:
        base = nodeid.split("[", 1)[0]
        _write(event="finish", impl=index, test=base)
        _left[(index, base)] -= 1
        if not _left[(index, base)]:
            _write(event="done", impl=index, test=base)


def pytest_sessionfinish(session):
    _write(event="end")
