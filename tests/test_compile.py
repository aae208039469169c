"""torch.compile with miniddp: both placements give torch DDP's gradients, DDPOptimizer splits the graph at the
buckets, and the trainer's torch_compile field compiles in pieces.

``aot_eager`` traces the forward and backward into graphs and runs them with eager kernels: the
compiler's whole path (dynamo, AOTAutograd), no C++ toolchain needed, so the test runs on any CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import miniddp
from miniddp.engine.compile_graph_split import DDPOptimizer
from miniddp.launching.spawn import run_on_ranks
from miniddp.training.cli import parse_config
from miniddp.training.tasks import make_task


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3))


def _compiled_nodes(loss) -> int:
    """Backward nodes that AOTAutograd made: one per compiled piece of the forward."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(n for n, _ in node.next_functions)
    return sum("CompiledFunction" in type(node).__name__ for node in seen)


def _placements(rank, world_size):
    base = _model()
    two_buckets = miniddp.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.0011)
    splitter = DDPOptimizer(two_buckets)
    wrappers = {
        "torch DDP, eager": torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base)),
        "miniddp DDP of a compiled model": miniddp.DistributedDataParallel(
            torch.compile(copy.deepcopy(base), backend="aot_eager")),
        "compiled miniddp DDP": torch.compile(miniddp.DistributedDataParallel(copy.deepcopy(base)),
                                              backend="aot_eager"),
        "compiled miniddp DDP, split at its buckets": torch.compile(two_buckets, backend=splitter),
    }
    grads, nodes = {}, {}
    for name, ddp in wrappers.items():
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        grads[name] = []
        for step in range(3):
            torch.manual_seed(100 * step + rank)  # each rank its own data: the gradients must be averaged
            x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))
            loss = nn.functional.cross_entropy(ddp(x), y)
            nodes[name] = _compiled_nodes(loss)
            loss.backward()
            grads[name].append([p.grad.clone() for p in ddp.parameters()])
            opt.step()
            opt.zero_grad()
    one_bucket = miniddp.DistributedDataParallel(_model())
    whole = DDPOptimizer(one_bucket)
    torch.compile(one_bucket, backend=whole)(torch.randn(8, 12)).sum().backward()
    return {"grads": grads, "nodes": nodes, "buckets": len(two_buckets.bucket_assignment),
            "pieces": max(splitter.pieces), "one_bucket_pieces": max(whole.pieces)}


@pytest.fixture(scope="module")
def placements():
    return run_on_ranks(_placements, 2, timeout=240)


def test_both_placements_of_torch_compile_give_torch_ddps_gradients(placements):
    for ranks in placements:
        grads = dict(ranks["grads"])
        reference = grads.pop("torch DDP, eager")
        for name, theirs in grads.items():
            for step, (a, b) in enumerate(zip(reference, theirs)):
                assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b)), f"{name}, step {step}"


# --8<-- [start:split]
def test_the_ddp_optimizer_splits_the_graph_where_the_buckets_change(placements):
    for ranks in placements:
        assert ranks["buckets"] == 2 and ranks["pieces"] == 2  # two buckets: two pieces
        assert ranks["one_bucket_pieces"] == 1  # one bucket: the graph stays whole
        # each piece is its own backward node, so a bucket can go out while the next piece computes;
        # compiled whole (the negative control), the backward is one node and all gradients come at its end
        assert ranks["nodes"]["compiled miniddp DDP, split at its buckets"] == 2
        assert ranks["nodes"]["compiled miniddp DDP"] == 1
# --8<-- [end:split]


def _train(rank, world_size, out, compiled):
    args = ["--output_dir", out, "--model", "mlp", "--max_steps", "3", "--per_device_train_batch_size", "8",
            "--logging_steps", "100", "--disable_tqdm", "true"]
    cfg = parse_config(args + (["--torch_compile_backend", "aot_eager"] if compiled else []))
    assert cfg.torch_compile == compiled  # the backend implies torch_compile, as in Transformers
    trainer = miniddp.Trainer(args=cfg, **make_task(cfg))
    trainer.train()
    assert (trainer.forward is not trainer.ddp) == compiled
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_the_trainer_compiles_with_torch_compile_and_trains_as_eager(tmp_path):
    eager = run_on_ranks(_train, 2, args=(str(tmp_path / "eager"), False), init=False, timeout=240)[0]
    compiled = run_on_ranks(_train, 2, args=(str(tmp_path / "compiled"), True), init=False, timeout=240)[0]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(eager, compiled))
