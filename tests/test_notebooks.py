"""Every tutorial notebook runs top to bottom in a real Jupyter kernel, and the outputs
saved in it (which the site shows) are what it prints today.

The notebooks assert what they show, so a wrong result fails here, not only a
crash. They are executed in a temporary copy; the committed file is not touched,
unless MINIDDP_REFRESH_NOTEBOOKS=1, which writes the fresh outputs back:

    MINIDDP_REFRESH_NOTEBOOKS=1 pytest tests/test_notebooks.py

Saved and fresh outputs are compared per code cell: the same output types in the same
order (which streams a cell writes, not how its chunks interleave), and the same stdout
once numbers (timings, pids, ports, losses), temporary paths, the repository's path,
the transport's own wording of an error and column alignment are masked, up to line
order and a few lines (see same_text). Images and stderr (warnings
carry timestamps) are compared by presence only.
"""

import difflib
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb"))
REFRESH = os.environ.get("MINIDDP_REFRESH_NOTEBOOKS") == "1"

_NUMBER = re.compile(r"(?<![A-Za-z_])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_TMP = re.compile(r"(/private)?/(tmp|var/folders)/[^\s'\"]*")
_SOURCE = re.compile(r"[^\s'\"(]*/(miniddp|tests|tutorials|benchmarks|examples)/")  # a clone anywhere: /work/x, /tmp/ci
_TRANSPORT = re.compile(r"(RuntimeError|DistBackendError|DistNetworkError): .*")  # gloo words a timeout several ways
# after miniddp's verdict comes the transport's own error, worded differently from run to run
_ORIGINAL = re.compile(r"(the original error follows\.)\n.*?(?=\n\s*\n|\Z)", re.S)


def normalise(text: str, cwd: str) -> str:
    """Mask what changes from run to run: the working directory, temp paths, addresses, numbers."""
    text = text.replace(cwd, "<cwd>")
    text = _SOURCE.sub(r"<repo>/\1/", text)  # before _TMP: the repository may itself be under /tmp
    text = _TMP.sub("<tmp>", text)
    text = _ORIGINAL.sub(r"\1\n<the transport's message>", text)
    text = _TRANSPORT.sub(r"\1: <the transport's message>", text)
    text = _HEX.sub("<addr>", text)
    text = _NUMBER.sub("#", text)
    return "\n".join(" ".join(line.split()) for line in text.strip().splitlines())  # column alignment too


def same_text(saved: str, fresh: str) -> bool:
    """Equal, up to the order of lines (traces of concurrent events) and a few lines that only
    some runs print (a gloo timeout reported twice): at least 80% of the lines in common."""
    if saved == fresh:
        return True
    a, b = sorted(saved.splitlines()), sorted(fresh.splitlines())
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio() >= 0.8


def summary(cell, cwd: str) -> dict:
    """What a cell shows, in comparable form."""
    streams, rich, stdout = set(), [], []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":  # chunks and their interleaving depend on timing
            streams.add(out["name"])
            if out["name"] == "stdout":
                stdout.append(out["text"])
        else:
            rich.append(f"{out['output_type']}:{','.join(sorted(out.get('data', {})))}")
    return {"outputs": sorted(streams) + rich, "stdout": normalise("".join(stdout), cwd)}


def test_there_are_notebooks():
    assert NOTEBOOKS, "tutorials/ has no notebooks"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_its_saved_outputs_are_fresh(path, tmp_path):
    saved = nbformat.read(path, as_version=4)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=240, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the failing cell, on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors

    if REFRESH:
        nbformat.write(nb, path)
        return
    stale = []
    code = [(i, s, f) for i, (s, f) in enumerate(zip(saved.cells, nb.cells)) if f.cell_type == "code"]
    for i, old, new in code:
        was, now = summary(old, str(tmp_path)), summary(new, str(tmp_path))
        if was["outputs"] != now["outputs"]:
            stale.append(f"cell {i}: saved outputs {was['outputs']}, a fresh run gives {now['outputs']}")
        elif not same_text(was["stdout"], now["stdout"]):
            stale.append(f"cell {i}: saved stdout differs from a fresh run:\n--- saved\n{was['stdout']}\n"
                         f"--- fresh\n{now['stdout']}")
    assert not stale, (f"{path.name}: the saved outputs are stale (refresh them with "
                       f"MINIDDP_REFRESH_NOTEBOOKS=1 pytest tests/test_notebooks.py):\n" + "\n".join(stale))
