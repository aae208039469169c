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
from .report import REPORT_ENV
from .skeleton import make_skeleton
from .swap import ENV, LearnerFileError, load

ROOT = Path(__file__).resolve().parents[2]  # the repository: the spec is its tests/
DEFAULT_DIR = "my_miniddp"
CHECK_TIMEOUT_S = 120  # per spec test: a ring that never receives is stopped, and named


def learner_file(name: str, folder) -> Path:
    return Path(folder) / f"{name}.py"


def run_check(name: str, path, *, timeout_s: float = CHECK_TIMEOUT_S, only=None,
              first_failure: bool = False) -> list[dict]:
    """Each spec item of exercise ``name`` (or those whose test is in ``only``) run against the file ``path``:
    ``{demands, test, passed, reason}``. ``first_failure``: stop there (the rest is reported as not run)."""
    chosen = exercise(name)
    spec = [item for item in chosen.spec if only is None or item.test in only]
    load(str(path), chosen.module, chosen.required)  # one clear line before anything runs
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        env = {**os.environ, ENV: f"{name}={os.path.abspath(path)}", REPORT_ENV: report}
        command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                   "-p", "miniddp.exercise.report", f"--timeout={int(timeout_s)}", "-W", "ignore",
                   *(["-x"] if first_failure else []), *[item.test for item in spec]]
        subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        results = json.load(open(report)) if os.path.exists(report) else {}
    items = []
    for item in spec:
        outcomes = results.get(item.test, [])
        failed = [reason for outcome, reason in outcomes if outcome == "failed"]
        passed = bool(outcomes) and not failed and any(outcome == "passed" for outcome, _ in outcomes)
        items.append({"demands": item.demands, "test": item.test, "passed": passed,
                      "reason": failed[0] if failed else ("" if passed else "did not run")})
    return items


def _status(name: str, folder) -> str:
    path = learner_file(name, folder)
    if not path.exists():
        return "not started"
    try:
        items = run_check(name, path)
    except LearnerFileError as err:
        return f"does not load: {err}"
    failing = sum(not i["passed"] for i in items)
    return "passing" if not failing else f"{failing} of {len(items)} spec items failing"


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
            for number, e in enumerate(EXERCISES, 1):
                print(f"{number:2}. {e.name:10} {', '.join(e.required):38} {_status(e.name, args.dir)}")
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
            print(f"      {item['reason']}  ({item['test']})")
    failing = sum(not i["passed"] for i in items)
    print(f"\n{chosen.name}: {len(items) - failing} of {len(items)} spec items pass; docs/{chosen.page}")
    return 0 if not failing else 1
