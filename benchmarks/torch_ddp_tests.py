"""torch's own DDP tests on gloo/CPU, run with torch's DistributedDataParallel and with miniddp's in its place.

    python benchmarks/torch_ddp_tests.py                          # both classes, writes the JSON below
    python benchmarks/torch_ddp_tests.py --c10d-tests ~/pytorch/test/distributed   # + test_c10d_gloo.py
    python benchmarks/torch_ddp_tests.py --check                  # miniddp's class only, against the record

What
    Two suites. ``distributed_test``: the DDP tests of ``DistributedTest._DistTestBase`` in the torch wheel
    (``torch/testing/_internal/distributed/distributed_test.py``): every test whose name says DDP
    (``ddp``, ``DDP``, ``DistributedDataParallel``) or whose body builds ``DistributedDataParallel``, itself
    or through a helper method; gloo, world size 3 (``--world-size``). ``c10d_gloo`` (only with
    ``--c10d-tests DIR``, a torch checkout's ``test/distributed`` folder; not shipped): every test of
    ``test_c10d_gloo.py``'s ``DistributedDataParallelTest`` (world size 2, fixed by the class). Each suite
    runs twice, as torch's class and with ``miniddp.drop_in.install()`` in every rank
    (``torch_ddp_testcases.py`` says how, and how the runner knows the swap happened). Writes
    ``benchmarks/results/torch_ddp_tests.json``: the counts per suite and class (run, passed, failed,
    skipped), each test's outcome, each failure's exception (first line), and miniddp's failures classified
    (``KNOWN`` below). ``--check`` runs miniddp's class only and exits 1 when a test the record has passing
    with miniddp no longer passes (so CI can run it); it writes nothing.

Why
    miniddp claims torch's semantics; torch's own tests are the strictest outside yardstick there is. A
    failure either shows a difference in public behaviour (to fix) or a test that reads torch's private
    internals (C++ reducer fields, logging data), which miniddp does not promise.

How torch differs
    torch's CI runs ``distributed_test.py`` through ``test/distributed/test_distributed_spawn.py`` with
    ``BACKEND=gloo WORLD_SIZE=3`` (``run_test.py``: 2 only on a machine with exactly 2 GPUs) and every test
    selected; here, on a machine without GPUs, the tests marked ``@skip_if_no_gpu`` /
    ``@skip_if_lt_x_gpu(n)`` are counted as skipped without spawning their ranks (each would start all its
    ranks only to skip inside them). torch's harness (``MultiProcessTestCase``) runs each test as it is;
    ``--test-timeout`` sets its ``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT`` (torch's default, 300 s).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "torch_ddp_tests.json"
IMPLS = ("torch", "miniddp")
CLASSES = {"distributed_test": "DistributedTestGloo", "c10d_gloo": "C10dGlooDDPTest"}
DDP_NAME = re.compile(r"ddp|distributeddataparallel", re.IGNORECASE)
# A decorator that skips inside each rank when the machine has too few accelerators.
NEEDS_GPU = re.compile(r"@skip_if_no_gpu\b|@skip_if_lt_x_gpu\((?![^)]*allow_cpu=True)")

# miniddp's failures, classified: "public" (torch's public behaviour differs: to fix) or "private" (the test
# reads torch's internals, out of scope). Filled from the recorded run; a failure not listed is "unclassified".
KNOWN: dict[str, tuple[str, str]] = {
    "test_ddp_logging_data_cpu": (
        "private", "_set_ddp_runtime_logging_sample_rate() and _get_ddp_logging_data()'s runtime statistics "
        "(avg_forward_compute_time, backward_comm_time_start, ...): torch's C++ logger"),
}


def distributed_test_selection() -> tuple[type, list[str]]:
    """The DDP tests of ``_DistTestBase``: by name, or because the body (or a helper it calls) builds DDP."""
    os.environ.setdefault("BACKEND", "gloo")
    os.environ.setdefault("WORLD_SIZE", "3")
    try:
        from torch.testing._internal.distributed.distributed_test import DistributedTest
    except ModuleNotFoundError as missing:  # torch's test utilities import expecttest, a test-only package
        raise SystemExit(f"torch's test modules need {missing.name!r}: pip install {missing.name}") from missing

    base = DistributedTest._DistTestBase
    sources = {}
    for name, value in vars(base).items():
        function = getattr(value, "__func__", value)
        if callable(function):
            try:
                sources[name] = inspect.getsource(inspect.unwrap(function))
            except (OSError, TypeError):
                pass
    builds = {name for name, text in sources.items() if "DistributedDataParallel" in text}
    grown = True
    while grown:  # helpers that reach a helper that builds DDP
        helpers = [h for h in builds if not h.startswith("test_")]
        new = {n for n, text in sources.items() if n not in builds
               and any(re.search(rf"self\.{re.escape(h)}\b", text) for h in helpers)}
        builds |= new
        grown = bool(new)
    tests = sorted(n for n in sources if n.startswith("test_") and (n in builds or DDP_NAME.search(n)))
    return base, tests


def c10d_selection(folder: str) -> tuple[type, list[str]]:
    """Every test of test_c10d_gloo.py's DistributedDataParallelTest (inherited ones included)."""
    sys.path.insert(0, folder)
    import test_c10d_gloo

    cls = test_c10d_gloo.DistributedDataParallelTest
    return cls, sorted(n for n in dir(cls) if n.startswith("test_"))


def needs_gpu(cls: type, name: str) -> str | None:
    """The reason a test would skip in its ranks on this machine (no accelerator), or None."""
    import torch

    if torch.accelerator.device_count() > 0:
        return None
    if getattr(getattr(cls, name), "__unittest_skip__", False):
        return None  # unittest skips it in the worker, with torch's reason, before any rank starts
    try:
        source = inspect.getsource(inspect.unwrap(getattr(cls, name)))
    except (OSError, TypeError):
        return None
    decorators = source.split("def ", 1)[0]
    found = NEEDS_GPU.search(decorators)
    return f"needs GPUs ({found.group(0).lstrip('@').rstrip('(')}), not spawned" if found else None


def run_class(impl: str, suite: str, tests: list[str], args) -> tuple[dict, list[str]]:
    """Run ``tests`` of one suite with one DDP class in a worker process; return records and rank proofs."""
    if not tests:
        return {}, []
    env = dict(os.environ, MINIDDP_TORCH_TESTS_DDP=impl, BACKEND="gloo", WORLD_SIZE=str(args.world_size),
               DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(args.test_timeout), MINIDDP_DROP_IN_QUIET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    if args.c10d_tests:
        env["MINIDDP_TORCH_TESTS_C10D_DIR"] = args.c10d_tests
    with tempfile.TemporaryDirectory() as scratch:
        out, proofs = Path(scratch) / "records.json", Path(scratch) / "proofs"
        proofs.mkdir()
        env["MINIDDP_TORCH_TESTS_PROOF"] = str(proofs)
        code = ("import sys, torch_ddp_testcases as t; "
                f"sys.exit(t.worker({CLASSES[suite]!r}, sys.argv[1:], {str(out)!r}))")
        log = Path(scratch) / "log"
        with open(log, "w") as sink:
            proc = subprocess.run([sys.executable, "-c", code, *tests], env=env, cwd=scratch, stdout=sink,
                                  stderr=subprocess.STDOUT, timeout=len(tests) * (args.test_timeout + 60))
        text = log.read_text()
        if args.verbose:
            print(text)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"{impl} {suite}: the worker exited {proc.returncode}:\n{text[-4000:]}")
        return json.loads(out.read_text()), [p.read_text() for p in proofs.iterdir()]


def check_proofs(impl: str, suite: str, records: dict, proofs: list[str]) -> None:
    """Fail loudly unless every rank that ran saw the expected class (and some ranks did run)."""
    spawned = [t for t, r in records.items() if r["outcome"] != "skipped"]
    wrong = [p for p in proofs if not p.startswith("miniddp." if impl == "miniddp" else "torch.")]
    if wrong or (impl == "miniddp" and spawned and not proofs):
        raise SystemExit(f"{impl} {suite}: the DDP swap did not happen in the ranks "
                         f"({len(proofs)} proofs, wrong: {sorted(set(wrong))[:3]})")
    problems = [t for t, r in records.items() if "DDP swap did not happen" in r.get("error", "")]
    if problems:
        raise SystemExit(f"{impl} {suite}: the DDP swap did not happen in the ranks of {problems}")


def counts(records: dict) -> dict:
    outcomes = [r["outcome"] for r in records.values()]
    skipped = outcomes.count("skipped")
    return {"selected": len(outcomes), "run": len(outcomes) - skipped, "passed": outcomes.count("passed"),
            "failed": outcomes.count("failed") + outcomes.count("error"), "skipped": skipped}


def run_suites(args, impls: tuple[str, ...]) -> dict:
    """Every selected suite with every class in ``impls``; at most ``--jobs`` workers at once."""
    suites = {"distributed_test": distributed_test_selection()}
    if args.c10d_tests:
        suites["c10d_gloo"] = c10d_selection(args.c10d_tests)
    if args.only:
        suites = {s: (cls, [t for t in tests if re.search(args.only, t)]) for s, (cls, tests) in suites.items()}
    plan, result = [], {}
    for suite, (cls, tests) in suites.items():
        gpu = {t: reason for t in tests if (reason := needs_gpu(cls, t))}
        result[suite] = {"selected": len(tests), "not_spawned": gpu}
        plan += [(impl, suite, [t for t in tests if t not in gpu]) for impl in impls]

    def one(job):
        impl, suite, tests = job
        started = time.monotonic()
        records, proofs = run_class(impl, suite, tests, args)
        check_proofs(impl, suite, records, proofs)
        print(f"{impl} {suite}: {len(tests)} tests in {time.monotonic() - started:.0f} s", flush=True)
        return job, records, round(time.monotonic() - started)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for (impl, suite, _), records, seconds in pool.map(one, plan):
            skipped = {t: {"outcome": "skipped", "reason": r} for t, r in result[suite]["not_spawned"].items()}
            everything = dict(sorted({**records, **skipped}.items()))
            result[suite][impl] = {"counts": counts(everything), "seconds": seconds, "tests": everything}
    for entry in result.values():
        del entry["not_spawned"]
    return result


def failures(suite_result: dict, impl: str) -> dict:
    tests = suite_result.get(impl, {}).get("tests", {})
    return {t: r.get("error", "") for t, r in tests.items() if r["outcome"] in ("failed", "error")}


def report(result: dict) -> None:
    for suite, entry in result.items():
        for impl in IMPLS:
            if impl in entry:
                c = entry[impl]["counts"]
                print(f"{suite:16} {impl:8} run {c['run']:3}  passed {c['passed']:3}  failed {c['failed']:3}  "
                      f"skipped {c['skipped']:3}  ({entry[impl]['seconds']} s)")
        for impl in IMPLS:
            for test, error in failures(entry, impl).items():
                kind = KNOWN.get(test, ("unclassified", ""))[0] if impl == "miniddp" else ""
                print(f"  {impl} FAIL {test} [{kind}]: {error}".replace(" []", ""))


def check(args) -> int:
    """miniddp's class against the record: 1 when a test recorded passing with miniddp no longer passes."""
    recorded = json.loads(Path(args.record).read_text())
    if "c10d_gloo" in recorded["suites"] and not args.c10d_tests:
        print("c10d_gloo: recorded, but not checked (no --c10d-tests DIR)")
    result = run_suites(args, ("miniddp",))
    report(result)
    regressions, gained = [], []
    for suite, entry in result.items():
        before = recorded["suites"].get(suite, {}).get("miniddp", {}).get("tests", {})
        for test, record in entry["miniddp"]["tests"].items():
            was = before.get(test, {}).get("outcome")
            if was == "passed" and record["outcome"] != "passed":
                regressions.append(f"{suite}.{test}: {record['outcome']} {record.get('error', '')}")
            elif was != "passed" and record["outcome"] == "passed":
                gained.append(f"{suite}.{test}")
    for line in gained:
        print(f"now passes with miniddp (record it: run without --check): {line}")
    for line in regressions:
        print(f"REGRESSION (passed with miniddp in the record): {line}")
    return 1 if regressions else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--c10d-tests", metavar="DIR", help="a torch checkout's test/distributed folder")
    parser.add_argument("--check", action="store_true", help="miniddp's class only, compared with --record")
    parser.add_argument("--record", default=str(OUT), help="the recorded JSON (default: benchmarks/results/...)")
    parser.add_argument("--world-size", type=int, default=3, help="distributed_test's WORLD_SIZE (torch CI: 3)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="workers at once")
    parser.add_argument("--test-timeout", type=int, default=300, help="seconds per test (torch's default)")
    parser.add_argument("--only", metavar="REGEX", help="only the selected tests whose name matches")
    parser.add_argument("--verbose", action="store_true", help="print each worker's log")
    args = parser.parse_args(argv)
    if args.c10d_tests:
        args.c10d_tests = str(Path(args.c10d_tests).expanduser().resolve())
    if args.check:
        return check(args)
    import torch

    started, load_start = time.monotonic(), round(os.getloadavg()[0], 1)  # other jobs on the machine slow it
    result = run_suites(args, IMPLS)
    report(result)
    for entry in result.values():
        entry["miniddp_failures"] = {t: {"error": e, "kind": KNOWN.get(t, ("unclassified", ""))[0],
                                         "why": KNOWN.get(t, ("", ""))[1]}
                                     for t, e in failures(entry, "miniddp").items()}
    record = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "command": "python benchmarks/torch_ddp_tests.py" + (" --c10d-tests DIR" if args.c10d_tests else ""),
              "world_size": {"distributed_test": args.world_size, "c10d_gloo": 2}, "jobs": args.jobs,
              "cpus": os.cpu_count(), "load_average_1min": {"start": load_start, "end": round(os.getloadavg()[0], 1)},
              "seconds": round(time.monotonic() - started), "suites": result}
    if args.only:
        print(f"--only: not written to {args.record}")
        return 0
    Path(args.record).parent.mkdir(parents=True, exist_ok=True)
    Path(args.record).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.record} ({record['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
