"""``miniddp exercise list | start NAME [--dir D] | check NAME [--dir D] | solution NAME``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .catalog import EXERCISES, exercise
from .report import BATCH_ENV, REPORT_ENV
from .skeleton import make_skeleton
from .swap import ENV, LearnerFileError, load

ROOT = Path(__file__).resolve().parents[2]  # the repository: the spec is its tests/
DEFAULT_DIR = "my_miniddp"
CHECK_TIMEOUT_S = 120  # per spec test: a ring that never receives is stopped, and named


def learner_file(name: str, folder) -> Path:
    return Path(folder) / f"{name}.py"


def run_checks(checks) -> list[list[dict]]:
    """Several implementations in one pytest session: ``checks`` is ``[(name, path, only, timeout_s)]``
    (``only``: those spec tests, or None for all); for each, its items ``{demands, test, passed, reason}``."""
    batch, specs = [], []
    for name, path, only, timeout_s in checks:
        chosen = exercise(name)
        spec = [item for item in chosen.spec if only is None or item.test in only]
        load(str(path), chosen.module, chosen.required)  # one clear line before anything runs
        batch.append({"use": f"{name}={os.path.abspath(path)}", "tests": [i.test for i in spec], "timeout": timeout_s})
        specs.append(spec)
    with tempfile.TemporaryDirectory() as tmp:
        report, listing = os.path.join(tmp, "report.json"), os.path.join(tmp, "batch.json")
        json.dump(batch, open(listing, "w", encoding="utf-8"))
        env = {k: v for k, v in os.environ.items() if k != ENV}  # the session itself starts as the reference
        env.update({BATCH_ENV: listing, REPORT_ENV: report})
        tests = dict.fromkeys(test for implementation in batch for test in implementation["tests"])
        command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                   "-p", "miniddp.exercise.report", "-W", "ignore", *tests]
        ran = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if not os.path.exists(report):  # pytest itself did not get going: its last words, not a traceback
            last = [line for line in (ran.stdout + ran.stderr).splitlines() if line.strip()] or [
                f"pytest exited {ran.returncode}"]
            raise LearnerFileError(f"the spec did not run: {last[-1]}")
        results = json.load(open(report, encoding="utf-8"))
    return [[_item(item, outcomes.get(item.test, [])) for item in spec] for spec, outcomes in zip(specs, results)]


def _item(item, outcomes) -> dict:
    failed = [reason for outcome, reason in outcomes if outcome == "failed"]
    passed = bool(outcomes) and not failed and any(outcome == "passed" for outcome, _ in outcomes)
    return {"demands": item.demands, "test": item.test, "passed": passed,
            "reason": failed[0] if failed else ("" if passed else "did not run")}


def run_check(name: str, path, *, timeout_s: float = CHECK_TIMEOUT_S, only=None) -> list[dict]:
    """Each spec item of exercise ``name`` (or those whose test is in ``only``) run against the file ``path``."""
    return run_checks([(name, path, only, timeout_s)])[0]


def _statuses(folder) -> list[str]:
    """Each exercise's status in ``folder``; the started ones are checked in one session."""
    status, started = {}, []
    for e in EXERCISES:
        path = learner_file(e.name, folder)
        if not path.exists():
            status[e.name] = "not started"
            continue
        try:
            load(str(path), e.module, e.required)
            started.append((e.name, path, None, CHECK_TIMEOUT_S))
        except LearnerFileError as err:
            status[e.name] = f"does not load: {err}"
    for (name, *_), items in zip(started, run_checks(started) if started else []):
        failing = sum(not i["passed"] for i in items)
        status[name] = "passing" if not failing else f"{failing} of {len(items)} spec items failing"
    return [status[e.name] for e in EXERCISES]


def main(argv=None) -> int:
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
            for number, (e, status) in enumerate(zip(EXERCISES, _statuses(args.dir)), 1):
                print(f"{number:2}. {e.name:11} {', '.join(e.required):38} {status}")
            return 0
        chosen = exercise(args.name)
        if args.command == "solution":
            print(f"{chosen.name}: the reference is {chosen.source}; its page is docs/{chosen.page}")
            return 0
        path = learner_file(chosen.name, args.dir)
        if args.command == "start":
            if path.exists():
                print(f"{path} exists: not overwritten (delete it to start again)")
                return 1
            path.parent.mkdir(parents=True, exist_ok=True)
            source = (ROOT / chosen.source).read_text(encoding="utf-8")
            path.write_text(make_skeleton(source, chosen.names, chosen.page, chosen.name), encoding="utf-8")
            print(f"wrote {path}: write {', '.join(chosen.names)}, then `miniddp exercise check {chosen.name}"
                  f"{'' if args.dir == DEFAULT_DIR else ' --dir ' + args.dir}`")
            return 0
        if not path.exists():
            print(f"{path} does not exist: `miniddp exercise start {chosen.name}` writes it")
            return 1
        items = run_check(chosen.name, path)
    except (ValueError, LearnerFileError) as err:
        print(f"miniddp exercise: {err}", file=sys.stderr)
        return 2
    for item in items:
        mark = "PASS" if item["passed"] else "FAIL"
        print(f"{mark}  {item['demands']}")
        if not item["passed"]:
            print(f"      {item['reason']}\n      held by {item['test']}; taught in docs/{chosen.page}")
    failing = sum(not i["passed"] for i in items)
    print(f"\n{chosen.name}: {len(items) - failing} of {len(items)} spec items pass; docs/{chosen.page}")
    return 0 if not failing else 1
