"""``miniddp exercise list | start NAME [--dir D] | check NAME [--dir D] | solution NAME``.

This process never runs a line of the learner's file: it reads and compiles it for a first one-line
error, then hands it to a bounded pytest session (``bounds.py``) that imports it and runs the spec.
SIGTERM and SIGHUP end it as Ctrl-C does, the session with it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

from .bounds import MEMORY_MB, pytest_command, run_bounded
from .catalog import EXERCISES, exercise
from .skeleton import make_skeleton
from .swap import ENV, LearnerFileError, defined_names, missing, read_source

ROOT = Path(__file__).resolve().parents[3]  # the repository: the spec is its tests/
DEFAULT_DIR = "my_miniddp"
CHECK_TIMEOUT_S = 120  # per test case: a ring that never receives is stopped, and named with each rank's stack


def learner_file(name: str, folder) -> Path:
    return Path(folder) / f"{name}.py"


def _preflight(name: str, path) -> None:
    """What can be said without running the file: it reads, compiles and defines the required names."""
    missing(path, exercise(name).required, defined_names(read_source(path)))


def check_batch(checks, memory_mb: float = MEMORY_MB) -> list:
    """``checks`` as ``run_checks`` takes them, in one bounded session (``bounds.py``); for each, its items,
    or the LearnerFileError of a file that did not import there (its module-level code runs only there)."""
    batch, specs = [], []
    for name, path, only, timeout_s in checks:
        chosen = exercise(name)
        specs.append([item for item in chosen.spec if only is None or item.test in only])
        batch.append({"use": f"{name}={os.path.abspath(path)}", "tests": [i.test for i in specs[-1]],
                      "timeout": timeout_s})
    env = {k: v for k, v in os.environ.items() if k != ENV}  # the session itself starts as the reference
    tests = dict.fromkeys(test for implementation in batch for test in implementation["tests"])
    outcomes = run_bounded(batch, memory_mb, pytest_command(tests), ROOT, env)
    return [LearnerFileError(outcome["load"]) if outcome["load"] else
            [_item(item, outcome["results"].get(item.test, []), spec) for item in spec]
            for spec, outcome in zip(specs, outcomes)]


def run_checks(checks, *, memory_mb: float = MEMORY_MB) -> list[list[dict]]:
    """Several implementations in one pytest session: ``checks`` is ``[(name, path, only, timeout_s)]``
    (``only``: those spec tests, or None for all; ``timeout_s``: per test case); for each, its items
    ``{demands, test, passed, reason, outcome, case, stopped, limit, after}`` (``item_fields``).
    A file that does not import raises LearnerFileError, one line naming it."""
    for name, path, *_ in checks:
        _preflight(name, path)
    results = check_batch(checks, memory_mb)
    for result in results:
        if isinstance(result, LearnerFileError):
            raise result
    return results


def _item(item, results, spec) -> dict:
    """One spec item from its cases' results: ``outcome`` is passed, failed, stopped (by the time limit or
    the memory cap: ``stopped``, ``limit``) or not run (``after``: the item of this file that hung first)."""
    failed = [r for r in results if r["outcome"] == "failed"]
    after = None if failed else next((r["after"] for r in results if r["outcome"] == "skipped" and r.get("after")),
                                     None)
    first = failed[0] if failed else {}
    passed = bool(results) and not failed and not after and any(r["outcome"] == "passed" for r in results)
    if failed:
        outcome, reason = ("stopped" if first.get("stopped") else "failed"), first["reason"]
    elif after:
        hung = next((i.demands for i in spec if i.test == after), after)
        outcome, reason = "not run", (f"not run: this file's \"{hung}\" was stopped first (a hang costs one "
                                      "timeout per file, not one per item)")
    else:
        outcome, reason = ("passed", "") if passed else ("not run", "did not run")
    return {"demands": item.demands, "test": item.test, "passed": passed, "reason": reason, "outcome": outcome,
            "case": first.get("case") or None, "stopped": first.get("stopped"), "limit": first.get("limit"),
            "after": after}


def run_check(name: str, path, *, timeout_s: float = CHECK_TIMEOUT_S, only=None, memory_mb: float = MEMORY_MB):
    """Each spec item of exercise ``name`` (or those whose test is in ``only``) run against the file ``path``."""
    return run_checks([(name, path, only, timeout_s)], memory_mb=memory_mb)[0]


def _statuses(folder) -> list[str]:
    """Each exercise's status in ``folder``; the started ones are checked in one session."""
    status, started = {}, []
    for e in EXERCISES:
        path = learner_file(e.name, folder)
        if not path.exists():
            status[e.name] = "not started"
            continue
        try:
            _preflight(e.name, path)
            started.append((e.name, path, None, CHECK_TIMEOUT_S))
        except LearnerFileError as err:
            status[e.name] = f"does not load: {err}"
    for (name, *_), items in zip(started, check_batch(started) if started else []):
        if isinstance(items, LearnerFileError):
            status[name] = f"does not load: {items}"
            continue
        failing = sum(not i["passed"] for i in items)
        status[name] = "passing" if not failing else f"{failing} of {len(items)} spec items failing"
    return [status[e.name] for e in EXERCISES]


def _start(chosen, path: Path, folder: str) -> int:
    if path.exists():
        print(f"{path} exists: not overwritten (delete it to start again)")
        return 1
    source = (ROOT / chosen.source).read_text(encoding="utf-8")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(make_skeleton(source, chosen.names, chosen.page, chosen.name), encoding="utf-8")
    except OSError as err:  # --dir is a file, lies under one, or cannot be written
        print(f"miniddp exercise: --dir {folder}: cannot write {path} there ({err.strerror}): give a folder you "
              "can write to", file=sys.stderr)
        return 2
    print(f"wrote {path}: write {', '.join(chosen.names)}, then `miniddp exercise check {chosen.name}"
          f"{'' if folder == DEFAULT_DIR else ' --dir ' + folder}`")
    return 0


def _report(chosen, items) -> int:
    for item in items:
        print(f"{'PASS' if item['passed'] else 'FAIL'}  {item['demands']}")
        if not item["passed"]:
            for line in item["reason"].splitlines():
                print(f"      {line}")
            print(f"      held by {item['test']}; taught in docs/{chosen.page}")
    passing = sum(i["passed"] for i in items)
    print(f"\n{chosen.name}: {passing} of {len(items)} spec items pass; docs/{chosen.page}")
    return 0 if items and passing == len(items) else 1  # 0 only when every item positively passed


@contextlib.contextmanager
def _signals_end_the_check():
    """SIGTERM and SIGHUP (a closed terminal) end the check as Ctrl-C does, through its ``finally`` blocks,
    which end the session (were this process killed outright, the session's keeper would end it)."""
    def stop(signum, frame):
        for name in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(name, signal.SIG_DFL)  # a second signal during the clean-up ends this process at once
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    before = {name: signal.signal(name, stop) for name in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:  # called in a process of its own (a test's), its handlers are its own again
        for name, handler in before.items():
            signal.signal(name, handler)


def main(argv=None) -> int:
    with _signals_end_the_check():
        return _main(argv)


def _main(argv) -> int:
    parser = argparse.ArgumentParser(prog="miniddp exercise", description="Build DDP yourself, checked by its spec.")
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="the exercises in learning order, with their status")
    for name, help_ in (("start", "write the learner's file"), ("check", "run the spec on the learner's file")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("name")
        p.add_argument("--dir", default=DEFAULT_DIR, help=f"the learner's folder (default ./{DEFAULT_DIR})")
    listing.add_argument("--dir", default=DEFAULT_DIR)
    sub.add_parser("solution", help="where the reference and its page are").add_argument("name")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            rows = [(f"{n:2}.", e.name, ", ".join(e.required), status)
                    for n, (e, status) in enumerate(zip(EXERCISES, _statuses(args.dir)), 1)]
            widths = [max(len(row[c]) for row in rows) for c in range(3)]  # from the data: no name overflows
            for row in rows:
                print(" ".join(cell.ljust(width) for cell, width in zip(row, widths)), row[3])
            return 0
        chosen = exercise(args.name)
        if args.command == "solution":
            print(f"{chosen.name}: the reference is {chosen.source}; its page is docs/{chosen.page}")
            return 0
        path = learner_file(chosen.name, args.dir)
        if args.command == "start":
            return _start(chosen, path, args.dir)
        if not path.is_file():
            print(f"{path} does not exist: `miniddp exercise start {chosen.name}` writes it")
            return 1
        items = run_check(chosen.name, path)
    except (ValueError, LearnerFileError) as err:
        print(f"miniddp exercise: {err}", file=sys.stderr)
        return 2
    return _report(chosen, items)
