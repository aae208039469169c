"""The check's pytest session, bounded in time and memory whatever the learner's file does.

What
    ``run_bounded(batch, memory_mb)`` runs the exercise plugin's pytest session (``report.py``)
    under a keeper (``keeper.py``) that holds every process the session starts, however it
    detaches, and kills them all when this process ends, whatever ends it. It watches the session
    from this process, which never imports the learner's file: it sums the memory of every process
    under the keeper (pytest, the forkserver, the ranks and whatever they start) and reads the
    session's journal, one JSON line per event (a file being imported, a test case started, a
    result). The session is killed, all of it, when its memory
    passes ``memory_mb`` or when the step in progress runs past its bound (a test case: its timeout
    plus a grace; importing a file: the same). The step in progress is then reported as stopped
    (for memory or time, with the cap), that implementation's remaining items as not run, and the
    other implementations go on in a fresh session.

Why
    A sampler whose ``__iter__`` never ends grows by gigabytes a minute, and a learner's file may
    ``os._exit(0)``: the check must end, say why, and never mistake a silent exit for a pass. The
    timeouts inside the session (``report.py``) stop a hang with the stacks; this is the bound
    that holds when they cannot (a loop that swallows the timeout, a C call that never returns).

How torch differs
    torch's own test runner (``run_test.py``) bounds each test file's subprocess with a timeout
    and kills it; it has no memory bound.
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

from .keeper import descendants
from .swap import LearnerFileError

BATCH_ENV, JOURNAL_ENV = "MINIDDP_EXERCISE_BATCH", "MINIDDP_EXERCISE_JOURNAL"
MEMORY_MB = 4096  # the whole session together (PSS); a reference check uses about 600 (docs/build-it-yourself.md)
GRACE_S = 20.0  # past a step's own timeout, before this process kills the session
BETWEEN_S = 300.0  # any other stretch without an event: pytest, torch and the spec's modules importing
POLL_S = 0.25
KEEPER_WAIT_S = 60.0  # for the keeper to have killed the whole session: SIGKILL takes effect at once
KEEPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keeper.py")  # run as a file: no torch
_PAGE = os.sysconf("SC_PAGE_SIZE")


def run_bounded(batch: list[dict], memory_mb: float, command, cwd, env) -> list[dict]:
    """Each implementation's outcome: ``{"load": None or why it did not load, "results": {test: [result,
    ...]}}``, where a step stopped by a bound has a result saying so. Sessions are repeated, without the
    implementation whose step ended the last one, until every implementation has run or stopped."""
    outcomes = [{"load": None, "results": {}} for _ in batch]
    todo = {i: list(b["tests"]) for i, b in enumerate(batch) if b["tests"]}  # pytest given no test runs them all
    while todo:
        order = list(todo)  # this session's implementation k is the batch's order[k]
        events, ending = _session([dict(batch[i], tests=todo[i]) for i in order], memory_mb, command, cwd, env)
        done, partial, hung = set(), {}, {}  # hung: implementation -> its test a timeout or a cap stopped
        for event in events:
            i, kind = order[event.get("impl", 0)], event["event"]
            if kind == "loaded" and event["error"]:
                outcomes[i]["load"] = event["error"]
            elif kind == "result":
                partial.setdefault((i, event["test"]), []).append(event)
                if event.get("stopped"):
                    hung.setdefault(i, event["test"])
            elif kind == "done":
                done.add((i, event["test"]))
        if ending is not None:
            if ending["step"] is None:  # nothing of a learner's was running: pytest itself did not get going
                raise LearnerFileError(ending["words"])
            step, i = ending["step"], order[ending["step"]["impl"]]
            if step["event"] == "load":
                outcomes[i]["load"] = f"{batch[i]['use'].partition('=')[2]}: importing it {ending['load']}"
            else:
                partial.setdefault((i, step["test"]), []).append({
                    "outcome": "failed", "case": step["case"], "reason": ending["case"],
                    "stopped": ending["stopped"], "limit": ending["limit"] or step["timeout"]})
                hung.setdefault(i, step["test"])
                done.add((i, step["test"]))
        for (i, test), results in partial.items():  # an item cut short by another file's end is run again whole
            if (i, test) in done:
                outcomes[i]["results"][test] = results
        for i, test in hung.items():  # the file's other items are not run, in this session or the next
            for rest in todo[i]:
                if (i, rest) not in done:
                    outcomes[i]["results"][rest] = [{"outcome": "skipped", "after": test, "reason": ""}]
        if ending is None:
            return outcomes
        todo = {j: [t for t in todo[j] if (j, t) not in done] for j in order}
        todo = {j: tests for j, tests in todo.items() if tests and j not in hung and not outcomes[j]["load"]}
    return outcomes


def _session(batch, memory_mb, command, cwd, env) -> tuple[list[dict], dict | None]:
    """Run one session: (its journal's events, None if it ended on its own with a complete journal, else what
    ended it: ``{"stopped": "memory"/"time"/None, "limit", "load"/"case": what to say of the import or the test
    case it ended, "step": that import or case (its journal event), "words": pytest's last line}``)."""
    with tempfile.TemporaryDirectory() as tmp:
        listing, journal = os.path.join(tmp, "batch.json"), os.path.join(tmp, "journal.jsonl")
        with open(listing, "w", encoding="utf-8") as f:
            json.dump(batch, f)
        open(journal, "w").close()
        # the keeper (``keeper.py``) runs the session and holds all it starts: it ends them all when this
        # process closes the keeper's stdin, which the kernel does too if this process is killed
        proc = subprocess.Popen([sys.executable, "-I", "-S", KEEPER, *command], cwd=cwd,
                                env={**env, BATCH_ENV: listing, JOURNAL_ENV: journal},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace",
                                start_new_session=True)  # a terminal's Ctrl-C or hangup reaches this process only
        tail = collections.deque(maxlen=40)  # its last words; read as it goes, so a chatty test never blocks
        reader = threading.Thread(target=lambda: tail.extend(proc.stdout), daemon=True)
        reader.start()
        events, state = [], {"step": None, "buffer": ""}
        try:
            with open(journal, encoding="utf-8") as feed:
                ending = _watch(proc, feed, batch, memory_mb, events, state)
        finally:  # however this ends (a bound, the session's own end, Ctrl-C here): nothing of it survives
            _end_session(proc)
            reader.join(5)
        step = state["step"]
    if ending is None and not (events and events[-1]["event"] == "end"):
        code = proc.returncode
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        ending = {"stopped": None, "limit": None,
                  "load": f"ended the check: the process exited ({how}) with no report (os._exit or a crash at "
                          "module level?); keep module-level code in functions",
                  "case": f"the check's process exited ({how}) while it ran, with no report: os._exit, a crash, or "
                          "the system killed it"}
    if ending is not None:
        words = [line.strip() for line in tail if line.strip()] or [f"pytest exited {proc.returncode}"]
        ending.update(step=step, words=f"the spec did not run: {words[-1]}")
    return events, ending


def _watch(proc, feed, batch, memory_mb, events, state) -> dict | None:
    """Read the journal and the session's memory until the session ends (None) or a bound ends it."""
    last, total = time.monotonic(), float("inf")
    while True:
        ended = proc.poll() is not None  # read the journal once more after the end: its last events
        time.sleep(0 if ended else POLL_S)
        *lines, state["buffer"] = (state["buffer"] + feed.read()).split("\n")  # a line being written waits
        for event in map(json.loads, lines):
            events.append(event)
            last = time.monotonic()
            if event["event"] in ("load", "start"):
                state["step"] = event
            elif event["event"] in ("loaded", "finish"):
                state["step"] = None
            elif event["event"] == "collected":  # the whole session's own bound, now that it is known
                total = last + BETWEEN_S + sum(n * (b["timeout"] + GRACE_S) for b, n in zip(batch, event["cases"]))
        if ended:
            return None
        step = state["step"]
        used, now = _memory_mb(proc.pid, memory_mb), time.monotonic()
        if used > memory_mb:
            cap = f"the check's processes used {used:.0f} MB together, over the memory cap of {memory_mb:g} MB"
            return {"stopped": "memory", "limit": memory_mb, "case": f"stopped: {cap}, while it ran",
                    "load": f"was stopped: {cap}"}
        if now - last > (batch[step["impl"]]["timeout"] + GRACE_S if step else BETWEEN_S) or now > total:
            limit = batch[step["impl"]]["timeout"] if step else None
            return {"stopped": "time", "limit": limit, "load": f"did not finish within {limit} s",
                    "case": f"stopped: still running {now - last:.0f} s after it began, past the time limit of "
                            f"{limit} s per test case, which did not stop it: the check was killed"}


def _memory_mb(keeper: int, cap_mb: float) -> float:
    """The session's memory: the sum of the resident sizes of the keeper's descendants (zombies hold none),
    counting a page shared by forked ranks once (PSS), which is read only when the cheaper sum of RSS, an
    upper bound, passes the cap."""
    members = [(pid, pages) for pid, state, pages in descendants(keeper) if state not in "ZX"]
    rss = sum(pages for _, pages in members) * _PAGE / 2**20
    if rss <= cap_mb:
        return rss
    pss = 0.0
    for pid, _ in members:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                pss += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024
        except (OSError, StopIteration):
            pass
    return pss


def _end_session(proc) -> None:
    """Close the keeper's lifeline and wait for it to have ended every process of the session; a keeper
    that does not end is killed (what it held is then orphaned: the one case this cannot cover)."""
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(KEEPER_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def pytest_command(tests) -> list[str]:
    """The session's command line: the plugin, every assertion shown whole and without colour codes, no capture
    (output streams to the watcher, never to a growing file), pytest-timeout off (the plugin times each case)."""
    return [sys.executable, "-m", "pytest", "-q", "-n", "0", "-s", "--color=no", "-p", "no:cacheprovider",
            "--timeout=0", "-o", "verbosity_assertions=2", "-p", "miniddp.teaching.exercise.report", "-W", "ignore",
            *tests]
