"""The house rules, as tests: the layers of docs/index.md hold, `ls miniddp` shows them, nothing imports in
a cycle, and every module stays small enough to read in one sitting.

import-linter (its contracts are in pyproject.toml, `.ci/run` runs it) is checked here against
negative controls: a copy of the package with one import that runs the wrong way must break the
contract that forbids it, so a contract that silently stopped checking would fail this file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "miniddp"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
# DESIGN.md's guideline: one idea per module, around 300 lines at most. This is the ceiling past which a
# module surely holds two ideas; below it, splitting is a reviewer's judgement, not a count.
MAX_LINES = 330

LAYERS = "Layers: each imports only the layers below it"
NO_HARNESS = "The library never imports its test harness"
NO_CYCLES = "No import cycles, at any depth"

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (the lint extra)")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the copy's miniddp, ahead of the installed one
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=120)


def _broken(output: str) -> set[str]:
    return {line[: -len(" BROKEN")] for line in output.splitlines() if line.endswith(" BROKEN")}


def test_the_package_keeps_its_layers():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not _broken(result.stdout)


@pytest.mark.parametrize("where, line, contract", [
    ("engine/_probe.py", "from ..training import config", LAYERS),  # the engine reaching up to training
    ("process_group/_probe.py", "from ..engine import bucketing", LAYERS),  # the ground floor reaching up
    ("engine/_probe.py", "from ..diagnostics import trace", LAYERS),  # diagnostics attach as observers only
    ("engine/_probe.py", "from ..costmodel import simulate", LAYERS),  # so does the cost model ("auto")
    ("engine/_probe.py", "from .. import zero", LAYERS),  # sharding builds on the engine, not the reverse
    ("zero/_probe.py", "from ..training import config", LAYERS),  # ZeRO sits below training
    ("diagnostics/_probe.py", "from ..costmodel import simulate", LAYERS),  # two independent rooms
    ("training/_probe.py", "from ..launching import spawn", LAYERS),  # training never starts processes
    ("launching/_probe.py", "from ..teaching import demo", LAYERS),  # launching is below teaching
    ("training/_probe.py", "from .. import testing", NO_HARNESS),  # the library importing its test harness
    ("teaching/_probe.py", "from ..testing import netlab", NO_HARNESS),  # even the top of the library
    ("by_hand/_probe.py", "from ..comm_hooks import grad_bucket", LAYERS),  # two independent layers
    ("collectives/_probe.py", "from ..comm_hooks import grad_bucket", LAYERS),  # collectives sit below the hooks
    ("data/_probe.py", "from ..process_group import env", LAYERS),  # the ground floor's two rooms stand apart
])
def test_an_import_the_wrong_way_breaks_its_contract(tmp_path, where, line, contract):
    shutil.copytree(PACKAGE, tmp_path / "miniddp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "miniddp" / where).write_text(line + "\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert contract in _broken(result.stdout), result.stdout


def test_a_cycle_breaks_the_acyclic_contract(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "miniddp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "miniddp" / "engine" / "_one.py").write_text("from . import _two\n")
    (tmp_path / "miniddp" / "engine" / "_two.py").write_text("from . import _one\n")
    result = _lint(tmp_path)
    assert NO_CYCLES in _broken(result.stdout), result.stdout


def test_no_module_is_far_past_the_300_line_guideline():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for p in PACKAGE.rglob("*.py")}
    assert len(sizes) > 30
    assert {path: n for path, n in sizes.items() if n > MAX_LINES} == {}


def test_no_two_modules_share_a_file_name():
    names = [p.name for p in (ROOT / "miniddp").rglob("*.py") if p.name != "__init__.py"]
    assert len(names) > 30
    assert sorted({n for n in names if names.count(n) > 1}) == []


def _contract_layers() -> list[list[str]]:
    """The layers contract's rows, ground floor first, each as its modules' names under miniddp."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    rows = next(c["layers"] for c in contracts if c["name"] == LAYERS)
    return [[m.strip().removeprefix("miniddp.") for m in re.split(r"[|:]", row)] for row in reversed(rows)]


def test_the_docs_the_contracts_and_the_folders_name_the_same_layers():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    documented = re.findall(r"^\| [^|]+ \| `miniddp/(\w+)/` \|", index, re.M)  # the layers table, ground floor first
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    contracted = [m for row in _contract_layers() for m in row if (PACKAGE / m / "__init__.py").exists()]
    assert sorted(documented) == folders == sorted(contracted)
    assert documented == contracted  # the same order: a row of the table never sits above one it may not import
    for module in (m for row in _contract_layers() for m in row if m not in contracted):
        assert (PACKAGE / f"{module}.py").exists(), module  # the entry points the contract names (__main__, train)
