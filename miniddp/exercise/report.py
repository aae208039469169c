"""A pytest plugin for ``miniddp exercise check``: several implementations in one session.

``pytest -p miniddp.exercise.report`` with ``MINIDDP_EXERCISE_BATCH=<file>`` reads
``[{"use": "<name>=<file>", "tests": [node ids], "timeout": seconds}, ...]``. Each test named
there runs once per implementation that names it, with that implementation in force
(``swap.use``) in this process and in every rank it starts. pytest, torch and the ranks'
forkserver start once for all of them: that is most of a check's cost.

It writes ``[{test id without parameters: [[outcome, the failure's line], ...]}, ...]``, one dict
per implementation, to ``MINIDDP_EXERCISE_REPORT``; the CLI folds parametrisations into one item.
"""

from __future__ import annotations

import functools
import json
import os

import pytest

from .swap import run_rank_as, use

BATCH_ENV, REPORT_ENV = "MINIDDP_EXERCISE_BATCH", "MINIDDP_EXERCISE_REPORT"
PARAM = "exercise_implementation"
_batch: list[dict] = []
_index: dict[str, int] = {}  # an item's node id -> the implementation it runs under
_results: list[dict] = []


def _reason(report) -> str:
    """The failure's last line (the exception and its message), never miniddp's traceback."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "failed"
    if lines[0].endswith(":") and len(lines) > 1:  # a rank's error: its traceback follows; keep its last line
        return f"{lines[0]} {lines[-1]}"[:300]
    return lines[0][:300]


def pytest_configure(config):
    path = os.environ.get(BATCH_ENV)
    if path:
        _batch[:] = json.load(open(path, encoding="utf-8"))
        _results[:] = [{} for _ in _batch]


def pytest_generate_tests(metafunc):
    base = metafunc.definition.nodeid.split("[", 1)[0]
    wanted = [i for i, implementation in enumerate(_batch) if base in implementation["tests"]]
    if wanted:
        metafunc.fixturenames.append(PARAM)
        metafunc.parametrize(PARAM, wanted, ids=[f"implementation{i}" for i in wanted])


@pytest.fixture(autouse=True)
def _exercise_implementation(request):
    """Autouse, so set up before the test's own fixtures: they are built under the implementation too."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or PARAM not in callspec.params:
        yield
        return
    import miniddp.testing as harness

    index = callspec.params[PARAM]
    if any(outcome == "failed" for outcome, _ in _results[index].get(request.node.nodeid.split("[", 1)[0], [])):
        pytest.skip("this spec item already failed for this implementation")  # a hang is waited out once
    value, original = _batch[index]["use"], harness.run_rank
    use(value)
    harness.run_rank = functools.partial(run_rank_as, value)  # a forked rank switches before it runs
    yield
    harness.run_rank = original


def pytest_collection_modifyitems(items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and PARAM in callspec.params:
            _index[item.nodeid] = index = callspec.params[PARAM]
            item.add_marker(pytest.mark.timeout(_batch[index]["timeout"]))


def pytest_runtest_logreport(report):
    index = _index.get(report.nodeid)
    if index is not None and (report.when == "call" or report.outcome == "failed" or report.skipped):
        base = report.nodeid.split("[", 1)[0]
        _results[index].setdefault(base, []).append([report.outcome, _reason(report) if report.failed else ""])


def pytest_sessionfinish(session):
    path = os.environ.get(REPORT_ENV)
    if path and _batch:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_results, f)
