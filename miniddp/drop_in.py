"""Drop-in: torch's ``DistributedDataParallel`` replaced by miniddp's, for a script that stays unchanged.

What
    ``python -m miniddp.drop_in SCRIPT [ARGS...]`` (or ``-m MODULE [ARGS...]``) runs the script as
    ``python SCRIPT ARGS`` would (its ``sys.argv``, ``__main__``, ``sys.path[0]`` and exit status), after
    ``install()``: ``torch.nn.parallel.DistributedDataParallel`` is miniddp's class from then on, and so is
    every name a module already imported holds for torch's. Works wherever the launcher puts it:
    ``torchrun ... -m miniddp.drop_in train.py``, ``accelerate launch -m miniddp.drop_in train.py``,
    ``srun python -m miniddp.drop_in train.py``, ``miniddp launch --drop_in train.py``. SCRIPT may be a folder
    or a zip file with a ``__main__.py``, as for Python. Processes the script starts with ``mp.spawn`` (or the
    spawn or forkserver start method) are fresh interpreters: each installs miniddp's class before it re-runs
    the script as ``__mp_main__``, and writes its own traces at its exit. From Python,
    ``undo = miniddp.drop_in.install()``; ``undo()`` puts torch's class back. Rank 0 prints one line saying
    so (``MINIDDP_DROP_IN_QUIET=1`` silences it). When the script ends, the process group the framework
    created and never destroyed is destroyed (bounded in time), so a finished job exits 0.
    The environment asks for miniddp's diagnostics: ``MINIDDP_DEBUG=collectives`` (the desync detector,
    wrapped around whatever group the framework creates) and ``MINIDDP_TRACE=DIR`` (per rank, the first
    ``MINIDDP_TRACE_STEPS`` synced backwards, default 20: ``rankR.trace.json`` for Perfetto,
    ``rankR.events.json`` for ``diagnostics.timeline.plot_timeline``, ``rankR.buckets.json``). Both are
    checked before the script runs (``launching/drop_in_checks.py``): a bad value is one line, exit status 2.

Why
    Transformers, TRL, Accelerate and Lightning build torch's DDP themselves, by name, inside code the user
    does not edit. Replacing the class before their code runs puts miniddp's engine (its buckets, its
    errors, its traces) under the user's real job, without a change to it.

How torch differs
    torch has no such switch. ``DistributedDataParallel`` is looked up by name at the call
    (``torch.nn.parallel.DistributedDataParallel``: Transformers, Accelerate) or bound at import
    (``from torch.nn.parallel import DistributedDataParallel``: Lightning), so both are replaced: the
    modules' attributes, and every module already in ``sys.modules`` that holds torch's class. A process
    that ``mp.spawn`` starts imports torch afresh: the switch rides in the preparation data that
    ``multiprocessing`` sends the child, which it unpickles before it runs the script.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing.spawn
import os
import pkgutil
import runpy
import sys
from pathlib import Path

import torch.distributed as dist
import torch.nn.parallel
import torch.nn.parallel.distributed

from .composed import DistributedDataParallel as _DistributedDataParallel
from .diagnostics.trace import Tracer, step_summary, to_chrome_trace
from .launching.drop_in_checks import TRACE_ENV, module_error, path_error, trace_folder_error, trace_steps
from .process_group import debug_backend
from .process_group.clean_exit import destroy_process_group

QUIET_ENV = "MINIDDP_DROP_IN_QUIET"
TORCH_DDP = torch.nn.parallel.DistributedDataParallel  # torch's own class, as it was when miniddp was imported
USAGE = "usage: python -m miniddp.drop_in SCRIPT [ARGS...]  |  python -m miniddp.drop_in -m MODULE [ARGS...]"
# every traced wrapper built in this process, its traces written at the end. Held, not weakly referenced: a
# script's `def main()` drops its wrapper when it returns, before the runner writes.
_built: list = []


class FirstSteps(Tracer):
    """A tracer that records the first ``steps`` synced backwards of a real job, then nothing (a long job's
    trace would grow without end)."""

    def __init__(self, rank: int, steps: int, device=None):
        super().__init__(rank, device)
        self.steps, self.ended = steps, 0

    def event(self, name: str, **fields) -> None:
        if self.ended < self.steps:
            super().event(name, **fields)

    def bucket_launched(self, bucket, future) -> None:
        if self.ended < self.steps:
            super().bucket_launched(bucket, future)

    def backward_ended(self) -> None:
        super().backward_ended()
        self.ended += 1


class DistributedDataParallel(_DistributedDataParallel):
    """miniddp's DDP under torch's name, as a framework builds it: with the diagnostics the environment asks
    for (``MINIDDP_TRACE``). ``isinstance(x, miniddp.DistributedDataParallel)`` holds for it."""

    def __init__(self, *args, **kwargs):
        if os.environ.get(TRACE_ENV) and kwargs.get("tracer") is None:
            module = kwargs.get("module", args[0] if args else None)
            device = next((p.device for p in module.parameters()), None) if module is not None else None
            kwargs["tracer"] = FirstSteps(dist.get_rank(), trace_steps(), device)
        super().__init__(*args, **kwargs)
        self._drop_in_tracer = kwargs.get("tracer")
        if self._drop_in_tracer is not None and os.environ.get(TRACE_ENV):
            _built.append(self)


def _checked_init(init):
    """``init_process_group`` that wraps gloo or NCCL in the desync detector when ``MINIDDP_DEBUG=collectives``."""
    def init_process_group(backend=None, *args, **kwargs):
        if debug_backend.enabled():
            inner = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            backend = debug_backend.register(inner)
            kwargs.pop("device_id", None)  # a Python group binds no device (as init_distributed does)
        return init(backend, *args, **kwargs)
    init_process_group.__wrapped__ = init
    return init_process_group


def install():
    """Make miniddp's class the one every name for torch's ``DistributedDataParallel`` gives (and, with
    ``MINIDDP_DEBUG=collectives``, every name for ``init_process_group`` a checked one); return ``undo``."""
    instead = {id(TORCH_DDP): DistributedDataParallel}
    if debug_backend.enabled():
        init = dist.distributed_c10d.init_process_group
        instead[id(init)] = _checked_init(init)
    swapped = []  # (holder, attribute, what it held), to undo
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("miniddp"):
            continue  # miniddp's own names for torch's class (TORCH_DDP above) stay torch's
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if id(value) in instead:
                swapped.append((module, name, value))
                setattr(module, name, instead[id(value)])

    def undo() -> None:
        for holder, name, value in reversed(swapped):
            setattr(holder, name, value)
    return undo


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


class _InstallInChild:
    """Rides in the preparation data ``multiprocessing`` sends a spawned child; unpickling it there, before
    the child re-runs the script as ``__mp_main__``, installs miniddp's class in the child."""

    def __reduce__(self):
        return _spawned_child, ()


def _spawned_child() -> None:
    """In a child that ``mp.spawn`` started: the switch, for it and its own children; its traces at its exit
    (``spawn_main`` ends with ``sys.exit``, so ``atexit`` runs)."""
    install()
    _pass_to_spawned_children()
    atexit.register(_finish)


def _pass_to_spawned_children():
    """Every child started by the spawn or forkserver method installs first; return ``undo``.

    ``get_preparation_data`` is what ``multiprocessing`` sends a new interpreter before the process object:
    its ``sys.path``, ``sys.argv``, the main module to re-run. ``prepare()`` in the child reads the keys it
    knows, and the child unpickles the whole dict first, so one more key runs our install there, early.
    (A forked child needs nothing: it is a copy of this process, class included.)"""
    original = multiprocessing.spawn.get_preparation_data

    def get_preparation_data(name):
        return {**original(name), "miniddp_drop_in": _InstallInChild()}

    multiprocessing.spawn.get_preparation_data = get_preparation_data

    def undo() -> None:
        multiprocessing.spawn.get_preparation_data = original
    return undo


def per_step(events: list[dict]) -> list[dict]:
    """``step_summary`` of each traced backward (events from one "backward start" to the next)."""
    steps, current = [], []
    for e in sorted(events, key=lambda e: e["t"]):
        if e["name"] == "backward start" and current:
            steps.append(current)
            current = []
        current.append(e)
    steps.append(current)
    names = [{e["name"] for e in step} for step in steps]
    return [step_summary(step) for step, seen in zip(steps, names) if {"backward start", "backward end"} <= seen]


def write_traces(folder: str) -> list[Path]:
    """Each traced wrapper's events, Chrome trace and bucket assignment, into ``folder`` (one set per rank).

    Files are named by the rank the wrapper was built on: a script may have destroyed its group by now."""
    written, out = [], Path(folder)
    for n, ddp in enumerate(d for d in _built if d._drop_in_tracer is not None):
        events = ddp._drop_in_tracer.synchronize()
        stem = f"rank{ddp._drop_in_tracer.rank}" + (f".{n}" if n else "")
        out.mkdir(parents=True, exist_ok=True)
        files = {f"{stem}.events.json": events, f"{stem}.trace.json": to_chrome_trace([events]),
                 f"{stem}.buckets.json": {"buckets": ddp.bucket_assignment, "steps": per_step(events)}}
        for name, content in files.items():
            (out / name).write_text(json.dumps(content, default=str))
            written.append(out / name)
    return written


def _finish() -> None:
    """After the script: its traces, then the group it left behind, destroyed within a bounded time."""
    folder = os.environ.get(TRACE_ENV)
    try:
        written = write_traces(folder) if folder else []
        if any(path.name.startswith("rank0.") for path in written):
            print(f"miniddp.drop_in: traces in {folder} ({len(written)} files on rank 0)", file=sys.stderr,
                  flush=True)
    except OSError as exc:  # the folder was checked before the script; something changed since: say so, go on
        print(f"miniddp.drop_in: writing the traces failed: {exc}", file=sys.stderr, flush=True)
    finally:
        _built.clear()
    try:
        destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the script's own outcome (and exit status) is what counts
        print(f"miniddp.drop_in: destroying the process group failed: {exc}", file=sys.stderr, flush=True)


def _environment_error() -> str | None:
    """The runner's variables, checked before the script runs: one line for a bad one, else None."""
    try:
        trace_steps()
    except ValueError as err:
        return str(err)
    folder = os.environ.get(TRACE_ENV)
    return trace_folder_error(folder) if folder else None


def main(argv: list[str] | None = None) -> int:
    """The runner: ``SCRIPT [ARGS...]`` or ``-m MODULE [ARGS...]``, run as Python would run it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr if argv[:1] not in (["-h"], ["--help"]) else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module = argv[1] if argv[0] == "-m" else None
    script = None if module else argv[0]
    bad_variable = _environment_error()
    problem = (bad_variable, 2) if bad_variable else path_error(script) if script is not None else None
    if problem:  # (one line, the exit status python gives; 2 for a bad variable, as for a bad flag)
        print(f"miniddp.drop_in: {problem[0]}", file=sys.stderr)
        return problem[1]
    undo, undo_spawn = install(), _pass_to_spawned_children()
    try:
        # after install(): the module's parent packages are imported by this check, and see miniddp's class
        missing = module_error(module) if module else None
        if missing:
            print(f"miniddp.drop_in: {missing[0]}", file=sys.stderr)
            return missing[1]
        if _rank() == 0 and os.environ.get(QUIET_ENV, "0") in ("", "0"):
            print(f"miniddp.drop_in: torch.nn.parallel.DistributedDataParallel is miniddp's ({QUIET_ENV}=1 "
                  "silences this)", file=sys.stderr, flush=True)
        try:
            if module:
                sys.argv = [module, *argv[2:]]  # python -m sets argv[0] to the module's file; runpy does that too
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [script, *argv[1:]]
                if pkgutil.get_importer(script) is None:
                    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` puts it
                else:
                    del sys.path[0]  # a folder or a zip file: run_path puts it first itself, as `python DIR` does
                runpy.run_path(script, run_name="__main__")
        finally:
            _finish()
    finally:
        undo_spawn()
        undo()
    return 0


if __name__ == "__main__":  # run the module proper, not this __main__ copy of it (one class, one _built)
    from miniddp.drop_in import main as _main

    sys.exit(_main())
