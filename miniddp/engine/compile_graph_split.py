"""A dynamo backend that splits a compiled graph where miniddp's buckets change, to restore overlap.

What
    ``torch.compile(ddp, backend=DDPOptimizer(ddp))``. Dynamo hands over each captured forward
    graph; walking it backwards (the order backward will run it), a new piece starts each time a
    parameter of a later bucket is met at its *first* use in the forward (where its gradient is
    complete: a tied embedding is finished by its first use, not by the LM head). Each piece is
    compiled on its own by the backend named (``aot_eager``: no compiler toolchain; ``inductor``),
    at its first call. ``pieces`` records how many pieces each graph became.

Why
    A compiled backward is one autograd node: every gradient appears when the whole graph has run,
    so DDP's buckets cannot go out while the backward computes. One node per bucket gives back
    what eager DDP had: the last layers' piece finishes, their bucket travels, the next piece runs.

How torch differs
    ``torch/_dynamo/backends/distributed.py`` (``DDPOptimizer``) applies by itself to a compiled
    torch DDP (``torch._dynamo.config.optimize_ddp``) and cuts where the parameter bytes, counted
    backwards, fill ``bucket_bytes_cap``, which matches the reducer's buckets when the graph is
    captured whole; here the cut follows the reducer's own assignment, parameter by parameter. It
    compiles each piece at split time under fake tensors; here at its first real call. Both use the
    buckets of the first iteration: a rebuild afterwards leaves the pieces as they were.
"""

from __future__ import annotations

import torch
from torch import fx


class DDPOptimizer:
    """A ``torch.compile`` backend for a model wrapped in ``miniddp.DistributedDataParallel``."""

    def __init__(self, ddp, backend: str = "aot_eager"):
        self.ddp = ddp
        self.backend = backend
        self.pieces: list[int] = []  # per graph dynamo compiled: how many pieces it was split into
        self.__name__ = f"DDPOptimizer({backend})"  # what dynamo's messages call a backend, not an object's repr

    def __call__(self, gm: fx.GraphModule, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend  # noqa: PLC0415 - only when compiling
        from torch.fx.passes.split_module import split_module  # noqa: PLC0415

        compile_piece = lookup_backend(self.backend)
        part = self.partition(gm)
        self.pieces.append(len(set(part.values())))
        if self.pieces[-1] <= 1:
            return compile_piece(gm, example_inputs)
        split = split_module(gm, None, lambda node: part[node])
        for name, piece in list(split.named_children()):
            setattr(split, name, _CompiledOnFirstCall(piece, compile_piece))
        return split

    # --8<-- [start:partition]
    def partition(self, gm: fx.GraphModule) -> dict:
        """Node -> piece number, in forward order: a piece ends where the graph, read backwards, first
        meets a parameter of a later bucket (at that parameter's first use in the forward)."""
        reducer = self.ddp.reducer
        index = {id(p): i for i, p in enumerate(reducer.params)}
        owner = {}  # parameter index -> the node of its first use in the forward
        for node in gm.graph.nodes:
            for source in node.all_input_nodes:
                i = index.get(id(_parameter_of(gm, source)))
                if i is not None and node.op != "output":
                    owner.setdefault(i, node)
        bucket_at = {node: reducer.where[i][0] for i, node in owner.items()}
        last = len(reducer.buckets) - 1
        part, bucket = {}, 0
        for node in reversed(gm.graph.nodes):  # backward's order: bucket 0 (the last layers) first
            bucket = max(bucket, bucket_at.get(node, 0))
            part[node] = last - bucket  # forward order: pieces numbered as they run
        return part
    # --8<-- [end:partition]


def _parameter_of(gm: fx.GraphModule, node: fx.Node):
    """The real parameter a graph input stands for: a placeholder dynamo lifted, or a ``get_attr``."""
    if node.op == "placeholder":
        arg = node.meta.get("grapharg")
        return getattr(arg, "example", None) if arg is not None else None
    if node.op == "get_attr":
        return getattr(gm, node.target, None)
    return None


class _CompiledOnFirstCall(torch.nn.Module):
    """One piece: compiled by the backend at its first call, with the real inputs as examples."""

    def __init__(self, piece: fx.GraphModule, compile_piece):
        super().__init__()
        self.single = False  # AOTAutograd wants tuple outputs: a lone one is wrapped, then unwrapped
        for node in piece.graph.nodes:
            if node.op == "output" and not isinstance(node.args[0], tuple):
                node.args, self.single = (node.args,), True
        piece.recompile()
        self.piece, self.compile_piece, self.compiled = piece, compile_piece, None

    def forward(self, *args):
        if self.compiled is None:
            self.compiled = self.compile_piece(self.piece, list(args))
        out = self.compiled(*args)
        return out[0] if self.single else out
