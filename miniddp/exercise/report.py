"""A pytest plugin for ``miniddp exercise check``: each test's outcome, as JSON, for the CLI to read.

``pytest -p miniddp.exercise.report`` with ``MINIDDP_EXERCISE_REPORT=<file>`` writes
``{test id without parameters: [outcome, first line of the failure]...}``; the CLI folds the
parametrisations into one spec item.
"""

from __future__ import annotations

import json
import os

REPORT_ENV = "MINIDDP_EXERCISE_REPORT"
_results: dict[str, list] = {}


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


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome == "failed" or report.skipped:
        base = report.nodeid.split("[", 1)[0]
        _results.setdefault(base, []).append([report.outcome, _reason(report) if report.failed else ""])


def pytest_sessionfinish(session):
    path = os.environ.get(REPORT_ENV)
    if path and not hasattr(session.config, "workerinput"):  # the controller, under xdist
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_results, f)
