"""One training step as the cost model sees it, read from a traced step.

What
    ``StepProfile`` holds a step's parts in seconds: the forward (and loss), when each
    gradient became ready from the backward's start, the tail of ``loss.backward()`` after
    the last all-reduce (copying the averages back into ``.grad``), the optimizer.
    ``StepProfile.from_events`` reads one rank's events (``miniddp.diagnostics.trace``: the
    reducer's ``grad ready`` events and the ``Tracer.span`` of forward and optimizer);
    ``StepProfile.slowest`` combines the ranks into the latest one at each point.

Why
    Overlap depends on *when* gradients become ready, not only on how many bytes there
    are: a bucket can start only when its last gradient exists. Trace the step once with
    one big bucket (nothing is sent during the backward) and the ready times are the
    compute alone; the simulation then replays them with any bucket size.

How torch differs
    torch's reducer records the same ready times (``backward_stats_`` in
    ``torch/csrc/distributed/c10d/reducer.cpp``) but only reports them, averaged, through
    ``DistributedDataParallel._get_ddp_logging_data()``.
"""

from __future__ import annotations

import dataclasses

import torch


# --8<-- [start:profile]
@dataclasses.dataclass
class StepProfile:
    """One step as the model sees it; times in seconds, ``ready_s`` from the backward's start."""

    forward_s: float
    ready_s: list[float]  # per parameter (registration order): when its gradient was ready
    numels: list[int]  # per parameter
    dtypes: list[torch.dtype]  # per parameter: buckets never mix dtypes
    tail_s: float = 0.0  # after compute and communication, until backward returns (copy-back)
    optimizer_s: float = 0.0
    compute_end_s: float = 0.0  # backward computing past the last gradient (an input's gradient, say)
    shapes: list[tuple] = dataclasses.field(default_factory=list)  # per parameter, if known: what PowerSGD sends

    @property
    def backward_s(self) -> float:  # backward's compute: until the last gradient, or later
        return max(self.compute_end_s, *self.ready_s)

    @property
    def nbytes(self) -> list[int]:
        return [n * torch.empty((), dtype=d).element_size() for n, d in zip(self.numels, self.dtypes)]

    @classmethod
    def from_events(cls, events: list[dict], named_params) -> StepProfile:
        """From one rank's events of one step (forward / optimizer spans recorded with
        ``Tracer.span``); ``named_params``: the wrapped module's ``named_parameters()``."""
        t = {}
        for e in sorted(events, key=lambda e: e["t"]):
            t.setdefault(e.get("param", e["name"]), e["t"])  # a gradient by its parameter's name
        named = [(n, p) for n, p in named_params if p.requires_grad]
        bw, end = t["backward start"], t["backward end"]
        ready = [t[n] - bw for n, _ in named]
        finished = [e["t"] - bw for e in events if e["name"] == "bucket finished"]
        forward = bw - t.get("forward start", bw)  # forward, and the loss: everything before backward
        optimizer = t.get("optimizer end", t.get("optimizer step", end)) - end
        tail = max(0.0, end - bw - max(ready + finished))
        return cls(forward, ready, [p.numel() for _, p in named], [p.dtype for _, p in named], tail, optimizer,
                   shapes=[tuple(p.shape) for _, p in named])

    @classmethod
    def slowest(cls, profiles: list[StepProfile]) -> StepProfile:
        """Ranks start a step together and a bucket finishes when the *last* rank launched it:
        combine per-rank profiles into one that is, at each point, the latest rank."""
        fwd = max(p.forward_s for p in profiles)
        ready = [max(p.forward_s + p.ready_s[i] for p in profiles) - fwd for i in range(len(profiles[0].ready_s))]
        return cls(fwd, ready, profiles[0].numels, profiles[0].dtypes, max(p.tail_s for p in profiles),
                   max(p.optimizer_s for p in profiles), max(p.forward_s + p.compute_end_s for p in profiles) - fwd,
                   profiles[0].shapes)
# --8<-- [end:profile]
