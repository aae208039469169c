"""No-sync gradient accumulation: communicate once per optimizer step, not per micro-batch.

What
    ``no_sync(ddp)`` (also ``ddp.no_sync()``) is a context manager: a backward whose *forward*
    ran inside it only accumulates ``.grad`` locally (the forward does not arm the reducer, whose
    hooks then just note the gradient in ``Accumulated``); the next synced backward averages the
    sums. ``should_sync`` says which micro-step of a ``gradient_accumulation_steps`` window
    syncs, ``accumulation_windows`` each window's real length.

Why
    All-reduce is linear: the mean of sums is the sum of means, so averaging every micro-batch
    sends k times the bytes for the same result. Only the last micro-batch of a window syncs
    (Hugging Face's Trainer and Accelerate's ``accelerator.accumulate`` do the same).

How torch differs
    The same semantics as ``DistributedDataParallel.no_sync`` (``torch/nn/parallel/distributed.py``):
    it flips ``require_backward_grad_sync``, read **during the forward**. Putting only the
    backward inside ``no_sync`` is the most repeated DDP bug (karpathy/build-nanogpt#30,
    huggingface/accelerate#1726): torch is silent, we warn when ``no_sync()`` is entered while a
    synced forward waits for its backward, and when a parameter changed inside the window.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager


# --8<-- [start:no_sync]
@contextmanager
def no_sync(ddp):
    """Inside: forwards arm no gradient hooks, so their backwards stay local. Sets ``ddp.require_backward_grad_sync``
    (which ``ddp``'s forward reads) to False for the block and gives it back its previous value at the exit, an
    exception's too (so a nested ``no_sync`` leaves it False)."""
    reducer = getattr(ddp, "reducer", None)
    if reducer is not None and reducer.waiting_for_backward:  # armed by a forward, backward not run yet
        warnings.warn("no_sync() was entered after a forward that ran outside it, and that forward's backward has "
                      "not run yet: the backward will still all-reduce, because DDP decides at the forward. Put the "
                      "forward inside no_sync(): `with model.no_sync(): model(x).sum().backward()`.",
                      UserWarning, stacklevel=3)
    ### BEGIN SOLUTION
    previous = ddp.require_backward_grad_sync  # nested no_sync restores correctly
    ddp.require_backward_grad_sync = False
    try:
        yield
    finally:
        ddp.require_backward_grad_sync = previous
    ### END SOLUTION
# --8<-- [end:no_sync]


def unprepared_backward_message(name: str) -> str:
    """A gradient arrived in a backward that no synced forward of the wrapper armed, and no ``no_sync``
    forward explains it: the module was called directly, or the same graph was backpropagated twice."""
    return (f"{name} got a gradient in a backward that no DistributedDataParallel forward prepared, so it was NOT "
            "averaged across ranks and the replicas will drift apart. Call the wrapper, not the module: loss = "
            "ddp(x), not model(x) or ddp.module(x) (and do not backpropagate one graph twice). For gradients that "
            "should stay local, run the forward inside ddp.no_sync().")


# --8<-- [start:changed_in_window]
class ChangedInWindow:
    """Parameters modified in place inside an accumulation window: ``optimizer.step()`` after a ``no_sync``
    backward steps each rank on its own local gradients, and the replicas differ from then on (torch
    is silent). ``p._version`` counts in-place writes: a snapshot at the window's first ``no_sync``
    forward, compared at the next synced forward, sees it without any communication."""

    def __init__(self, named_params):
        self.named = list(named_params)  # (name, parameter) pairs DDP averages
        self.versions: list[int] | None = None  # at the window's first no_sync forward
        self.warned = False  # once per wrapper

    def local_forward(self) -> None:
        if self.versions is None:
            self.versions = [p._version for _, p in self.named]

    def synced_forward(self) -> None:
        if self.versions is not None and not self.warned:
            changed = next((n for (n, p), v in zip(self.named, self.versions) if p._version != v), None)
            if changed is not None:
                self.warned = True
                warnings.warn(f"{changed} was modified inside a no_sync() accumulation window (optimizer.step() "
                              "after a no_sync backward?): each rank changed it from its own local gradients, so the "
                              "replicas now differ, and nothing will bring them back together. Step the optimizer "
                              "only after the window's synced backward.", UserWarning, stacklevel=5)  # the ddp(x) call
        self.versions = None
# --8<-- [end:changed_in_window]


class Accumulated:
    """Which parameters got a gradient since the last synced backward, ``no_sync`` micro-steps included
    (torch keeps the same in ``local_used_map``), and whether a ``no_sync`` forward explains a gradient
    that arrives in a backward no synced forward armed."""

    def __init__(self, num_params: int):
        self.flags = [False] * num_params
        self.local_forward = False  # a no_sync forward ran since the last synced backward: local gradients expected
        self.warned = False  # the "gradient no forward prepared" warning, once

    def add(self, i: int) -> None:
        self.flags[i] = True

    def __contains__(self, i: int) -> bool:
        return self.flags[i]

    def unarmed(self, name: str) -> None:
        """``name`` got a gradient in an unarmed backward: fine after a ``no_sync`` forward, else warned once."""
        if not self.local_forward and not self.warned:
            self.warned = True
            warnings.warn(unprepared_backward_message(name), UserWarning, stacklevel=3)

    def clear(self) -> None:
        """A synced backward averaged everything: nothing is accumulated any more."""
        self.flags = [False] * len(self.flags)
        self.local_forward = False


# --8<-- [start:schedule]
def should_sync(step: int, gradient_accumulation_steps: int, num_batches: int | None = None) -> bool:
    """Does micro-batch ``step`` (0-based, within the epoch) end an accumulation window?

    Yes on the *last* micro-batch of each window, ``(step + 1) % k == 0``, and on
    the last batch of the epoch. The classic off-by-one, ``step % k == 0``, syncs
    the *first* micro-batch instead: the optimizer then steps on one micro-batch's
    average plus k-1 unsynchronised local gradients, and the replicas drift apart.
    """
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} must be >= 1")
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    ### BEGIN SOLUTION
    last_of_epoch = num_batches is not None and step + 1 == num_batches
    return (step + 1) % gradient_accumulation_steps == 0 or last_of_epoch
    ### END SOLUTION


def accumulation_windows(num_batches: int, gradient_accumulation_steps: int) -> list[int]:
    """Lengths of the windows an epoch splits into: ``(10, 4) -> [4, 4, 2]``; each ends at a step where
    ``should_sync(step, gradient_accumulation_steps, num_batches)`` is True.

    Divide each micro-batch's loss by its window's *real* length, so a short last
    window is still an average and not a sum scaled down by k.
    """
    ### BEGIN SOLUTION
    ends = [s for s in range(num_batches) if should_sync(s, gradient_accumulation_steps, num_batches)]
    return [end - start for start, end in zip([-1] + ends, ends)]
    ### END SOLUTION
# --8<-- [end:schedule]
