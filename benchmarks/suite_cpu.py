"""Where the test suite's time goes: CPU seconds per test, every process it started included.

Run (root, Linux with cgroup v1's cpuacct, as on this project's machines):

    python benchmarks/suite_cpu.py [pytest arguments...]

The suite is CPU-bound on 2 cores (the machine is ~97% busy through a run), so its wall time is
about its CPU time over the cores, and what to cut is what costs CPU. ``--durations`` cannot say
that: a test's seconds there are mostly waiting for the CPU that other workers' tests hold, and a
test's CPU is spent in processes it started (ranks, torchrun, kernels, Chromium). So each xdist
worker moves itself into a cgroup of its own, which its children inherit, and every test's CPU is
the difference of that cgroup's ``cpuacct.usage`` before and after it. Prints CPU per file and per
test and the machine's utilisation; writes ``benchmarks/results/suite_cpu.json``.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
OUT_ENV = "MINIDDP_SUITE_CPU_DIR"
_group: Path | None = None


# --- the plugin, loaded in every xdist worker (-p suite_cpu) ---------------------------------------
def pytest_configure(config):
    global _group
    worker, out = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(OUT_ENV)
    if worker and out:
        _group = CPUACCT / f"{Path(out).name}-{worker}"  # the run's own name: runs never share a group
        _group.mkdir(exist_ok=True)
        (_group / "cgroup.procs").write_text(str(os.getpid()))


def _usage() -> float:
    return int((_group / "cpuacct.usage").read_text()) / 1e9


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _group is None:
        yield
        return
    cpu, start = _usage(), time.monotonic()
    yield
    line = {"test": item.nodeid, "wall": time.monotonic() - start, "cpu": _usage() - cpu, "start": start,
            "worker": os.environ["PYTEST_XDIST_WORKER"]}
    with open(Path(os.environ[OUT_ENV]) / f"{line['worker']}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


# --- the runner ------------------------------------------------------------------------------------
def _machine_busy(samples: list, stop: threading.Event) -> None:
    """The share of the machine's CPU time that was not idle, every 5 s."""
    def read():
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
        return fields[3], sum(fields)
    idle, total = read()
    while not stop.wait(5):
        i, t = read()
        samples.append(1 - (i - idle) / max(1, t - total))
        idle, total = i, t


def main(args: list[str]) -> int:
    if not (CPUACCT / "cgroup.procs").exists() or not os.access(CPUACCT, os.W_OK):
        print(f"needs a writable cgroup v1 cpuacct hierarchy at {CPUACCT} (root)", file=sys.stderr)
        return 2
    out = Path(tempfile.mkdtemp(prefix="miniddp-suite-cpu-"))
    (out / "plugin").mkdir()  # on the path: this file alone, not benchmarks/ (network.py, memory.py...)
    (out / "plugin" / "suite_cpu.py").symlink_to(Path(__file__).resolve())
    env = {**os.environ, OUT_ENV: str(out),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(out / "plugin"), os.environ.get("PYTHONPATH")]))}
    samples, stop = [], threading.Event()
    threading.Thread(target=_machine_busy, args=(samples, stop), daemon=True).start()
    start = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "pytest", "-p", "suite_cpu", "-q", "-p", "no:cacheprovider", *args],
                           env=env)
    wall = time.monotonic() - start
    stop.set()
    tests = [json.loads(line) for f in out.glob("*.jsonl") for line in f.read_text().splitlines()]
    by_file = collections.defaultdict(lambda: {"cpu": 0.0, "wall": 0.0, "tests": 0})
    for t in tests:
        f = by_file[t["test"].split("::")[0]]
        f["cpu"] += t["cpu"]
        f["wall"] += t["wall"]
        f["tests"] += 1
    total = sum(t["cpu"] for t in tests)
    busy = sum(samples) / len(samples) if samples else float("nan")
    print(f"\n{len(tests)} tests, {wall:.0f} s wall, {total:.0f} CPU-s in tests, machine busy {busy:.0%}, "
          f"{os.cpu_count()} cores\n\nCPU-s  wall-s  tests  file")
    for name, f in sorted(by_file.items(), key=lambda kv: -kv[1]["cpu"])[:20]:
        print(f"{f['cpu']:6.1f}  {f['wall']:6.1f}  {f['tests']:5d}  {name}")
    print("\nCPU-s  wall-s  test")
    for t in sorted(tests, key=lambda t: -t["cpu"])[:20]:
        print(f"{t['cpu']:6.1f}  {t['wall']:6.1f}  {t['test']}")
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    (results / "suite_cpu.json").write_text(json.dumps(
        {"wall_s": wall, "cpu_s": total, "busy": busy, "cores": os.cpu_count(), "exit": code,
         "files": by_file, "tests": sorted(tests, key=lambda t: -t["cpu"])}, indent=1))
    for group in CPUACCT.glob(f"{out.name}-*"):
        try:
            group.rmdir()  # empty once its worker and every process it started have exited
        except OSError:
            print(f"{group} still holds a process: a test left one behind", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
