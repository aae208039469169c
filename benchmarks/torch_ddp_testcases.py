"""torch's own DDP test classes, with torch's ``DistributedDataParallel`` or miniddp's in its place.

What
    The unittest classes that ``torch_ddp_tests.py`` runs, and the worker that runs a list of their tests
    and writes one JSON record per test. ``MINIDDP_TORCH_TESTS_DDP=miniddp`` in the environment makes this
    module call ``miniddp.drop_in.install()`` when it is imported, before torch's test modules are:
    ``torch.nn.parallel.DistributedDataParallel`` and the name each test module bound at its import are
    then miniddp's class. ``=torch`` (the default) leaves torch's.

    - ``DistributedTestGloo``: ``DistributedTest._DistTestBase`` from the wheel's
      ``torch/testing/_internal/distributed/distributed_test.py``, one process per rank as torch's CI runs
      it for gloo (``BACKEND=gloo``, ``WORLD_SIZE`` from the environment, 3 by default).
    - ``C10dGlooDDPTest``: ``DistributedDataParallelTest`` from a torch checkout's
      ``test/distributed/test_c10d_gloo.py``, when ``MINIDDP_TORCH_TESTS_C10D_DIR`` names that folder (the
      class fixes its own world size, 2).

Why
    Each rank is a fresh interpreter (``multiprocessing`` spawn) that unpickles the test class by its
    module's name, so the swap must happen when that module is imported, in every rank. A class defined
    here is imported by name in every rank, and so is the swap. Each rank also checks that the swap
    happened (``run_test``) and leaves a proof file; the runner refuses a miniddp run without them.

How torch differs
    torch's ``test/distributed/test_distributed_spawn.py`` builds the same kind of class from
    ``TestDistBackend`` and ``_DistTestBase`` and is run by ``run_test.py`` with ``BACKEND``, ``WORLD_SIZE``
    and ``TEMP_DIR`` set; it has no switch for another DDP class. The selection, the counts and the JSON
    are miniddp's.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import unittest
from pathlib import Path

IMPL_ENV, C10D_ENV, PROOF_ENV = "MINIDDP_TORCH_TESTS_DDP", "MINIDDP_TORCH_TESTS_C10D_DIR", "MINIDDP_TORCH_TESTS_PROOF"
IMPL = os.environ.get(IMPL_ENV, "torch")
if IMPL not in ("torch", "miniddp"):
    raise SystemExit(f"{IMPL_ENV}={IMPL!r}: expected 'torch' or 'miniddp'")

# distributed_test.py reads these at its import; torch's CI sets them for gloo (WORLD_SIZE 3 without 2 GPUs).
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "3")

import torch.nn.parallel  # noqa: E402

if IMPL == "miniddp":
    # Before torch's test modules bind ``DistributedDataParallel`` at their import (install() also rebinds
    # names already bound, so the order is a second safety, not the only one).
    import miniddp.drop_in  # noqa: E402

    miniddp.drop_in.install()
EXPECTED = torch.nn.parallel.DistributedDataParallel  # the class every rank must see

from torch.testing._internal.common_distributed import MultiProcessTestCase  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402


def swap_problem(test_module) -> str | None:
    """What is wrong with the class this process's DDP names give, or None when all are the expected one."""
    names = {"torch.nn.parallel.DistributedDataParallel": torch.nn.parallel.DistributedDataParallel,
             f"{test_module.__name__}.DistributedDataParallel": getattr(test_module, "DistributedDataParallel")}
    if IMPL == "miniddp" and not EXPECTED.__module__.startswith("miniddp"):
        return f"miniddp's drop-in was not installed: DistributedDataParallel is {EXPECTED.__module__}'s"
    wrong = [f"{name} is {value.__module__}.{value.__qualname__}" for name, value in names.items()
             if value is not EXPECTED]
    return f"DDP swap did not happen in this rank ({IMPL} expected): " + "; ".join(wrong) if wrong else None


class _CheckedRanks:
    """Every rank checks, before the test body, that its DDP names give the expected class; a rank that
    finds otherwise fails the test through torch's own error pipe, and each rank leaves a proof file."""

    test_module = distributed_test

    def run_test(self, test_name: str, parent_pipe) -> None:
        problem = swap_problem(self.test_module)
        if problem is not None:
            parent_pipe.send(problem)
            sys.exit(MultiProcessTestCase.TEST_ERROR_EXIT_CODE)
        if os.environ.get(PROOF_ENV):
            proof = Path(os.environ[PROOF_ENV]) / f"{test_name}.rank{self.rank}.{os.getpid()}"
            proof.write_text(f"{EXPECTED.__module__}.{EXPECTED.__qualname__}")
        super().run_test(test_name, parent_pipe)


class DistributedTestGloo(_CheckedRanks, distributed_test.TestDistBackend,
                          distributed_test.DistributedTest._DistTestBase):
    """torch's distributed_test.py tests, one spawned process per rank (as torch's spawn suite builds it)."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()


C10D_DIR = os.environ.get(C10D_ENV)
if C10D_DIR:
    sys.path.insert(0, C10D_DIR)
    import test_c10d_gloo  # noqa: E402  (from a torch checkout's test/distributed, given on the command line)

    class C10dGlooDDPTest(_CheckedRanks, test_c10d_gloo.DistributedDataParallelTest):
        """test_c10d_gloo.py's DistributedDataParallelTest (and what it inherits from test_c10d_common.py)."""

        test_module = test_c10d_gloo


def first_line(err: tuple) -> str:
    """The first line of the exception a test ended with; for a rank's failure (torch's harness raises
    ``RuntimeError('Process N exited ... exception:\\n<traceback>')``), the first failing rank's exception."""
    kind, value, _ = err
    text = str(value)
    marker = "exception:\n"
    if kind is RuntimeError and text.startswith("Process ") and marker in text:
        rank = text.split(" ", 2)[1]
        rank_traceback = text.split(marker, 1)[1].split("\nProcess ", 1)[0]
        return f"rank {rank}: {last_exception_line(rank_traceback)}"
    return f"{kind.__name__}: {text.strip().splitlines()[0] if text.strip() else ''}".rstrip(": ")


def last_exception_line(tb: str) -> str:
    """The first line of the last exception in a formatted traceback (the one that ended it)."""
    lines = tb.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return lines[0] if lines else ""
    for line in lines[starts[-1] + 1:]:
        if line and not line[0].isspace():
            return line
    return lines[-1]


class _Recorder(unittest.TestResult):
    """One record per test: outcome, the exception's first line (or the skip reason), seconds."""

    def __init__(self, out: dict):
        super().__init__()
        self.out, self.started = out, 0.0

    def startTest(self, test):
        super().startTest(test)
        self.started = time.monotonic()
        print(f"[{IMPL}] {test._testMethodName} ...", end=" ", flush=True)

    def _record(self, test, outcome: str, detail: str | None = None):
        record = {"outcome": outcome, "seconds": round(time.monotonic() - self.started, 1)}
        if detail:
            record["error" if outcome in ("failed", "error") else "reason"] = detail
        self.out[test._testMethodName] = record
        print(outcome, f"({record['seconds']} s)", detail or "", flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "failed", first_line(err))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "error", first_line(err))
        if not str(err[1]).startswith("Process "):
            traceback.print_exception(*err)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skipped", reason.splitlines()[0] if reason else None)


def worker(class_name: str, tests: list[str], out_file: str) -> int:
    """Run ``tests`` of the class ``class_name`` one after the other; write ``{test: record}`` to out_file."""
    cls = globals()[class_name]
    records: dict = {}
    suite = unittest.TestSuite(cls(name) for name in tests)
    suite.run(_Recorder(records))
    Path(out_file).write_text(json.dumps(records, indent=1))
    return 0
