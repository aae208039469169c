"""The rooms of the package: each folder's door says what it holds, and ``import miniddp`` does nothing else.

A door is a folder's ``__init__.py`` docstring: its files, each in a phrase, and the rooms it may import.
Here every file a door names must exist where it says (in the room, in the package, in the repository,
or in torch's own source for a ``torch/...`` path), every dotted name (``module.function``,
``Class.method``) must import and resolve, every file of the room must be named, and every room named
under "May import" must be one the import-linter layers contract (``pyproject.toml``) lets it import.
The folders are listed when the test runs, so a file moved or renamed is caught at its door.

``import miniddp`` re-exports names and nothing more: it does not swap an exercise's names in (even with
``MINIDDP_EXERCISE`` set) and does not load the cost model; ``bucket_cap_mb="auto"`` reaches the cost model
through ``miniddp.DistributedDataParallel``'s class attribute (``miniddp/composed.py``).
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

import miniddp
from miniddp.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "miniddp"
TORCH_SOURCE = Path(torch.__file__).resolve().parent.parent  # the folder that holds torch/
FILE = re.compile(r"[\w./-]*\w\.py\b")
DOTTED = re.compile(r"``([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?``")
NOT_CODE = (".md", ".json", ".yaml", ".yml", ".toml", ".txt", ".hpp", ".cpp", ".h")  # file names of other kinds
LAYERS = "Layers: each imports only the layers below it"


def rooms() -> list[Path]:
    """Every package under miniddp/ (not the root), as it is on disk now."""
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE
                  and "__pycache__" not in p.parts)


def door(room: Path) -> str:
    return ast.get_docstring(ast.parse((room / "__init__.py").read_text(encoding="utf-8"))) or ""


def _dotted_module(room: Path) -> str:
    return ".".join(("miniddp", *room.relative_to(PACKAGE).parts))


def _contract() -> list[tuple[list[str], str]]:
    """The layers contract's rows, ground floor first: (their modules under miniddp, the separator)."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    rows = next(c["layers"] for c in contracts if c["name"] == LAYERS)
    return [([m.strip().removeprefix("miniddp.") for m in re.split(r"[|:]", row)], ":" if ":" in row else "|")
            for row in reversed(rows)]


def may_import(room_name: str) -> set[str]:
    """The rooms (folders and root modules) a room may import: every row below its own, its own room, and the
    rest of its row when the row's rooms may import each other (``:``)."""
    rows = _contract()
    index = next(i for i, (modules, _) in enumerate(rows) if room_name in modules)
    below = {m for modules, _ in rows[:index] for m in modules}
    modules, separator = rows[index]
    return below | {room_name} | (set(modules) if separator == ":" else set())


def _section(text: str, title: str) -> str:
    """The lines under a heading of the door (a line of its own at no indent), up to the next heading."""
    match = re.search(rf"^{re.escape(title)}\n((?:[ \t]+.*\n?|\n)*)", text, re.M)
    return match.group(1) if match else ""


# --- what a door may say --------------------------------------------------------------------------------------------

def file_problems(room: Path, text: str) -> list[str]:
    """Each file the door names that is not where it says."""
    problems = []
    for name in FILE.findall(text):
        if name.startswith("torch/"):
            places = [TORCH_SOURCE / name]
        elif "/" in name:
            places = [room / name, PACKAGE / name, ROOT / name]
        else:
            places = [room / name]  # a bare name is a file of this room
        if not any(place.is_file() for place in places):
            problems.append(f"{name}: no such file ({', '.join(str(p.relative_to(p.anchor)) for p in places)})")
    return problems


def _walk(obj, names: list[str]):
    for name in names:
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif isinstance(obj, type(sys)):
            obj = importlib.import_module(f"{obj.__name__}.{name}")  # a submodule not imported yet
        else:
            raise AttributeError(f"{obj!r} has no {name}")
    return obj


def _start(room: Path, first: str):
    """What the first part of a dotted name is: a module of this room, a room or root module of miniddp,
    miniddp or torch themselves, or a name one of this room's modules defines (a class, a function)."""
    if (room / f"{first}.py").is_file() or (room / first / "__init__.py").is_file():
        return importlib.import_module(f"{_dotted_module(room)}.{first}")
    if first in ("miniddp", "torch"):
        return importlib.import_module(first)
    if (PACKAGE / f"{first}.py").is_file() or (PACKAGE / first / "__init__.py").is_file():
        return importlib.import_module(f"miniddp.{first}")
    for path in sorted(room.glob("*.py")):
        module = importlib.import_module(_dotted_module(room) + ("" if path.stem == "__init__" else f".{path.stem}"))
        found = vars(module).get(first)
        if found is not None and getattr(found, "__module__", module.__name__) == module.__name__:
            return found
    raise LookupError(f"{first} is no module of this room or of miniddp, and no name its modules define")


def name_problems(room: Path, text: str) -> list[str]:
    """Each dotted name in double backquotes (``module.function``, ``Class.method``) that does not resolve."""
    problems = []
    for dotted in DOTTED.findall(text):
        if dotted.endswith((".py", *NOT_CODE)):
            continue  # a file name: file_problems checks it
        first, *rest = dotted.split(".")
        try:
            _walk(_start(room, first), rest)
        except (ImportError, AttributeError, LookupError) as err:
            problems.append(f"{dotted}: {type(err).__name__}: {err}")
    return problems


def unnamed_files(room: Path, text: str) -> list[str]:
    """The room's files (and sub-rooms, ``name/``) that its door does not name."""
    named = set(FILE.findall(text))
    files = [p.name for p in room.glob("*.py") if p.name != "__init__.py"]
    subrooms = [p.parent.name for p in room.glob("*/__init__.py")]
    return sorted([f for f in files if f not in named] + [f"{s}/" for s in subrooms if f"{s}/" not in text])


def _may_import_part(text: str) -> str:
    """What the door says it may import: its "May import" section, else its paragraph from "may import" (or
    "imports") on."""
    section = _section(text, "May import")
    if section.strip():
        return section
    match = re.search(r"\b(?:may import|imports)\b(.|\n(?!\s*\n))*", text, re.I)  # to the end of that paragraph
    return match.group(0) if match else ""


def import_problems(room: Path, text: str) -> list[str]:
    """A door that does not say what it may import, or names a room the layers contract keeps it from."""
    section = _may_import_part(text)
    if not section.strip():
        return ["no 'May import' section"]
    known = {m for modules, _ in _contract() for m in modules}
    named = {m.group(1) for m in re.finditer(r"``(\w+)(?:[/.][\w./]*)?``", section) if m.group(1) in known}
    allowed = may_import(room.relative_to(PACKAGE).parts[0])
    return [f"names {name}, which the layers contract does not let it import" for name in sorted(named - allowed)]


# --- every door ----------------------------------------------------------------------------------------------------

ROOMS = rooms()


def test_every_room_has_a_door():
    assert len(ROOMS) >= 12
    assert [str(r.relative_to(PACKAGE)) for r in ROOMS if len(door(r).splitlines()) < 4] == []


@pytest.mark.parametrize("room", ROOMS, ids=[str(r.relative_to(PACKAGE)) for r in ROOMS])
def test_a_door_names_only_what_exists_and_everything_its_room_holds(room):
    text = door(room)
    assert file_problems(room, text) == []
    assert name_problems(room, text) == []
    assert unnamed_files(room, text) == []
    assert import_problems(room, text) == []


def test_the_engine_door_maps_one_gradient_from_hook_to_grad():
    engine = PACKAGE / "engine"
    path = _section(door(engine), "One gradient's path, from autograd to ``.grad``")
    steps = [re.findall(r"``([\w.]+)``", step) for step in re.split(r"^\s+\d\. ", path, flags=re.M)[1:]]
    assert len(steps) == 5  # hook, readiness, bucket, collective, .grad
    for step in steps:  # each step names its files, and in each a function or method (checked below to exist)
        files = {n[: -len(".py")] for n in step if n.endswith(".py")}
        functions = {n.split(".")[0] for n in step if "." in n.strip(".") and not n.endswith(".py")}
        assert files and files <= functions, step
    assert name_problems(engine, path) == [] and file_problems(engine, path) == []
    named = " ".join(" ".join(s) for s in steps)
    for where in ("autograd_hooks.hook_once", "bucketing.Bucket.put", "bucket_collective.BucketCollective.issue",
                  "bucketing.Bucket.write_back"):
        assert where in named, where


# --- the checks can fail ----------------------------------------------------------------------------------------------

def test_a_door_naming_a_missing_file_is_caught():
    engine = PACKAGE / "engine"
    assert file_problems(engine, "``bucketing.py`` and ``miniddp/composed.py``") == []  # the positive case
    assert len(file_problems(engine, "``bucketing.py`` and ``no_such_module.py``")) == 1
    assert len(file_problems(engine, "``trace.py``")) == 1  # another room's file, named as if it were here
    assert len(file_problems(engine, "``torch/distributed/no_such_file.py``")) == 1
    assert file_problems(engine, "``torch/nn/parallel/distributed.py``") == []


def test_a_door_naming_a_missing_function_or_method_is_caught():
    engine = PACKAGE / "engine"
    assert name_problems(engine, "``bucketing.Bucket.put`` ``Bucket.write_back`` ``torch.distributed.all_reduce``"
                                 " ``miniddp.launching.spawn.run_on_ranks`` ``observers.bucket_cap_chooser()``") == []
    assert len(name_problems(engine, "``bucketing.Bucket.no_such_method``")) == 1
    assert len(name_problems(engine, "``bucketing.no_such_function``")) == 1
    assert len(name_problems(engine, "``NoSuchClass.put``")) == 1
    assert len(name_problems(engine, "``no_such_module.function``")) == 1


def test_a_door_that_leaves_a_file_out_or_names_a_room_above_is_caught():
    engine = PACKAGE / "engine"
    whole = door(engine)
    assert unnamed_files(engine, whole.replace("``bucketing.py``", "")) == ["bucketing.py"]
    assert import_problems(engine, "What\n    x\n") == ["no 'May import' section"]
    assert import_problems(engine, "May import\n    ``process_group`` and ``training``\n") == [
        "names training, which the layers contract does not let it import"]
    assert import_problems(PACKAGE / "training", "May import\n    ``engine`` and ``costmodel.simulate``\n") == []


# --- no side effects at `import miniddp` --------------------------------------------------------------------------

PROBE = """
import json, sys
import miniddp
{after_import}
print(json.dumps({{"loaded": sorted(m for m in sys.modules if m.startswith(("miniddp.costmodel", "miniddp.teaching"))),
                   "sampler": miniddp.ShardSampler.__module__}}))
"""
# what importing miniddp did before: the learner's names swapped in, and the cost model loaded to register itself
OLD_IMPORT = """
from miniddp.teaching.exercise.swap import apply_from_env
apply_from_env()
import miniddp.costmodel.auto_bucket
"""


def _fresh_import(tmp_path, after_import: str = "") -> dict:
    learner = tmp_path / "my_sharding.py"
    learner.write_text("class ShardSampler:  # a learner's, in place of the reference\n    pass\n")
    env = {**os.environ, "MINIDDP_EXERCISE": f"sharding={learner}"}
    done = subprocess.run([sys.executable, "-c", PROBE.format(after_import=after_import)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_import_miniddp_swaps_nothing_and_loads_no_cost_model(tmp_path):
    got = _fresh_import(tmp_path)
    assert got == {"loaded": [], "sampler": miniddp.ShardSampler.__module__}  # the reference's, not the learner's


def test_negative_control_the_probe_sees_the_old_import_side_effects(tmp_path):
    got = _fresh_import(tmp_path, OLD_IMPORT)
    assert "._learner_" in got["sampler"]  # swapped in
    assert "miniddp.costmodel.auto_bucket" in got["loaded"] and "miniddp.teaching.exercise.swap" in got["loaded"]


def test_auto_reaches_the_cost_model_through_the_composed_class():
    from miniddp import drop_in
    from miniddp.costmodel.auto_bucket import AutoBucketCap
    from miniddp.engine.ddp import DistributedDataParallel as EngineDDP
    from miniddp.engine.observers import bucket_cap_chooser
    from miniddp.training import prepare

    with pytest.raises(ValueError):  # the engine alone knows no named cap: it never imports the cost model
        bucket_cap_chooser("auto", EngineDDP.bucket_cap_choosers)
    assert isinstance(bucket_cap_chooser("auto", miniddp.DistributedDataParallel.bucket_cap_choosers), AutoBucketCap)
    assert bucket_cap_chooser(25, miniddp.DistributedDataParallel.bucket_cap_choosers) is None  # a number: no chooser
    assert issubclass(miniddp.DistributedDataParallel, EngineDDP)
    # the drop-in's class and the trainer's wrapper are the composed one, so "auto" works under both
    assert issubclass(drop_in.DistributedDataParallel, miniddp.DistributedDataParallel)
    assert prepare.DistributedDataParallel is miniddp.DistributedDataParallel


def _auto_under_the_drop_in(rank, world_size):
    from miniddp import drop_in

    loaded_before = "miniddp.costmodel.auto_bucket" in sys.modules  # a rank as `import miniddp` leaves it
    undo = drop_in.install()
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb="auto")  # a script that names torch's
        for _ in range(2):  # the rebuild, where "auto" chooses, comes before the second synced forward
            ddp(torch.randn(4, 8)).sum().backward()
        ddp(torch.randn(4, 8))
        return loaded_before, isinstance(ddp, drop_in.DistributedDataParallel), ddp.auto_bucket_cap_mb
    finally:
        undo()


def test_auto_under_the_drop_in_in_every_rank():
    results = run_on_ranks(_auto_under_the_drop_in, 2, timeout=120)
    assert [r[:2] for r in results] == [(False, True)] * 2  # no cost model until a wrapper asked; miniddp's class
    assert results[0][2] is not None and results[0][2] == results[1][2]  # chosen, and agreed by both ranks
