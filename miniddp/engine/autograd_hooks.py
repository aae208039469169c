"""How the reducer attaches to autograd: one hook per parameter, and the start of a backward.

What
    ``hook_once(param, fn, owner)`` registers ``fn`` as ``param``'s post-accumulate-grad hook and
    removes the one an earlier wrapper of the same parameter left, marking that wrapper's reducer
    ``superseded``. ``on_backward_start(outputs, params, fn)`` calls ``fn()`` when a backward that
    will accumulate into one of ``params`` reaches the forward's ``outputs``.

Why
    Wrapping a model again (a notebook cell run twice) must not leave the old reducer reacting
    to every backward. Knowing at the outputs that a backward started lets the reducer queue its
    end-of-backward callback and mark the parameters the graph walk found unused before any
    gradient arrives. A gradient penalty's ``torch.autograd.grad(out, x)`` runs the graph too but
    fills no ``.grad``: it must not consume the sync that the forward armed.

How torch differs
    ``reducer.cpp`` hooks each parameter's ``AccumulateGrad`` node in C++ and removes its hooks
    when the reducer is destroyed; it queues ``finalize_backward`` from the first parameter's hook,
    so an ``autograd.grad`` call for other inputs, which runs no ``AccumulateGrad`` node, never
    starts it: the same outcome, with no question to ask the engine.
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import get_gradient_edge

from .unused import find_tensors

_HOOKED: dict[int, tuple] = {}  # id(parameter) -> (weak ref to it, handle of its miniddp hook, weak ref to its Reducer)


def hook_once(param, fn, owner):
    """Register ``fn`` on ``param``, removing the hook an earlier wrapper of the same parameter left.
    The old owner is marked superseded: its wrapper's next forward raises instead of averaging nothing."""
    old = _HOOKED.get(id(param))
    if old is not None and old[0]() is param:
        old[1].remove()
        previous = old[2]()
        if previous is not None and previous is not owner:
            previous.superseded = True
    handle = param.register_post_accumulate_grad_hook(fn)
    _HOOKED[id(param)] = (weakref.ref(param, lambda _, key=id(param): _HOOKED.pop(key, None)), handle,
                          weakref.ref(owner))
    return handle


def on_backward_start(outputs, params, fn) -> None:
    """Call ``fn()`` when a backward that reaches ``params`` arrives at any tensor of ``outputs``."""
    def hook(grad):
        if reaches_parameters(params):
            fn()
        return grad

    for t in find_tensors(outputs):  # backward starts where the outputs' gradients arrive
        if t.requires_grad and t.grad_fn is not None:
            t.register_hook(hook)


# --8<-- [start:reaches]
def reaches_parameters(params) -> bool:
    """Will the running backward accumulate into a parameter's .grad? ``loss.backward()``: yes;
    ``torch.autograd.grad(out, x)`` (a gradient penalty): no, and it must not consume the sync."""
    for p in params:
        try:
            if torch._C._will_engine_execute_node(get_gradient_edge(p).node):
                return True
        except RuntimeError:  # torch refuses the question for autograd.grad's own inputs: not ours
            pass
    return False
# --8<-- [end:reaches]
