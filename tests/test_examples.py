"""The examples a user copies run as their docstrings say, under torchrun and under `miniddp launch`."""

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BIN = Path(sys.executable).parent  # torchrun and the miniddp console script are installed beside this python
LAUNCHERS = {
    "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"],
    "miniddp launch": [str(BIN / "miniddp"), "launch", "--num_processes", "2"],  # no config: a free port too
}


def _run(command, cwd) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if torch.cuda.device_count() < 2:  # two processes cannot share one GPU under NCCL: then both run on the CPU
        env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _load(name):
    """Import an example as a user would copy it: a plain file, not a package of this repository."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["ddp_by_hand", "custom_model_trainer"])
def test_examples_are_self_contained(name):
    source = (EXAMPLES / f"{name}.py").read_text()
    tree = ast.parse(source)
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"argparse", "contextlib", "os", "torch", "miniddp"}, imported  # nothing from tests/
    assert ast.get_docstring(tree).startswith(("DDP by hand", "Your own model"))
    assert re.search(rf"torchrun --standalone --nproc-per-node 2 examples/{name}.py", source)
    assert re.search(rf"miniddp launch --num_processes 2 examples/{name}.py", source)
    assert len(source.splitlines()) <= 120
    _load(name)  # importing runs nothing: main() is behind `if __name__ == "__main__"`


# --- ddp_by_hand: 2 processes x 16 train the same model as 1 process x 32 ----------------------------

BY_HAND = ["--epochs", "2", "--gradient_accumulation_steps", "3"]  # 32 micro-batches an epoch: windows 3, ..., 3, 2


@pytest.fixture(scope="module")
def one_process_on_the_global_batch(tmp_path_factory):
    where = tmp_path_factory.mktemp("one")
    _run([sys.executable, str(EXAMPLES / "ddp_by_hand.py"), *BY_HAND, "--batch_size", "32", "--out", "one.pt"], where)
    return torch.load(where / "one.pt", weights_only=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_ddp_by_hand_on_two_processes_equals_one_process_on_the_global_batch(
        launcher, tmp_path, one_process_on_the_global_batch):
    out = _run([*LAUNCHERS[launcher], str(EXAMPLES / "ddp_by_hand.py"), *BY_HAND, "--batch_size", "16",
                "--out", "model.pt"], tmp_path)
    losses = [float(x) for x in re.findall(r"epoch \d: loss ([0-9.]+) \(world_size=2\)", out)]
    assert len(losses) == 2 and losses[1] < losses[0], out  # rank 0 alone prints; it learns
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]  # saved once, the .tmp renamed away
    two, one = torch.load(tmp_path / "model.pt", weights_only=True), one_process_on_the_global_batch
    assert two.keys() == one.keys() and not any(k.startswith("module.") for k in two)
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


# --- custom_model_trainer: a user's model and dataset through miniddp.Trainer ------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_custom_model_trains_through_the_trainer_on_two_processes(launcher, tmp_path):
    _run([*LAUNCHERS[launcher], str(EXAMPLES / "custom_model_trainer.py"), "--output_dir", "out",
          "--max_steps", "60", "--gradient_accumulation_steps", "2"], tmp_path)
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["global_step"] == 60
    assert metrics["effective_batch_size"] == 16 * 2 * 2  # per device x world size x accumulation
    assert 0 < metrics["eval_mae"] < 0.5  # compute_metrics' "mae", prefixed as Hugging Face does
    example = _load("custom_model_trainer")
    model = example.SineRegressor()
    model.load_state_dict(torch.load(tmp_path / "out" / "final_model.pt", weights_only=True))  # the plain model's
    held_out = example.NoisySine(256, seed=1)
    with torch.no_grad():
        trained = model(held_out.x, labels=held_out.y)["loss"].item()
        untrained = example.SineRegressor()(held_out.x, labels=held_out.y)["loss"].item()
    assert trained < untrained / 3, (trained, untrained)  # it learned the curve, not just the mean


def test_the_page_quotes_the_examples_own_lines():
    page = (EXAMPLES.parent / "docs" / "your-script.md").read_text()
    source = (EXAMPLES / "ddp_by_hand.py").read_text()
    quoted = re.findall(r"^\| `([^`]+)` \|", page, re.M)  # the first cell of the "why" table
    assert len(quoted) >= 8
    for line in quoted:
        assert line.split("...")[0] in source, f"docs/your-script.md quotes a line that is not in the example: {line}"
