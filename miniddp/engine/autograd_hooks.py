"""How the reducer attaches to autograd: one hook per parameter, and the start of a backward.

What
    ``hook_once(param, method, index)`` registers ``method(index, param)`` as ``param``'s
    post-accumulate-grad hook and removes the one an earlier wrapper of the same parameter left,
    marking that wrapper's reducer ``superseded``. The parameter holds the reducer weakly: a deleted
    wrapper's hooks go with it. ``on_backward_start(outputs, params, fn)`` calls ``fn()`` when a
    backward that will accumulate into one of ``params`` reaches the forward's ``outputs``.

Why
    Wrapping a model again (a notebook cell run twice) must not leave the old reducer reacting
    to every backward, nor may a wrapper deleted while its model lives (it warned of gradients
    "NOT averaged" in a backward of the bare model). Knowing at the outputs that a backward started
    lets the reducer queue its end-of-backward callback and mark the parameters the graph walk
    found unused before any gradient arrives. A gradient penalty's ``torch.autograd.grad(out, x)``
    runs the graph too but fills no ``.grad``: it must not consume the sync that the forward armed.

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


def hook_once(param, method, index: int):
    """Register ``method(index, param)`` (a bound method of a reducer) on ``param``, removing the hook an earlier
    wrapper of the same parameter left; that reducer is marked superseded: its wrapper's next forward raises
    instead of averaging nothing. The hook holds the reducer weakly, and the reducer's end removes the hook
    (torch: ``~Reducer`` removes its autograd hooks)."""
    owner, weak = method.__self__, weakref.WeakMethod(method)
    old = _HOOKED.get(id(param))
    if old is not None and old[0]() is param:
        old[1].remove()
        previous = old[2]()
        if previous is not None and previous is not owner:
            previous.superseded = True

    def hook(p):  # post-accumulate-grad hooks receive the parameter itself
        bound = weak()
        if bound is not None:  # None: the wrapper is gone, its finalizer below not yet run
            bound(index, p)

    handle = param.register_post_accumulate_grad_hook(hook)
    weakref.finalize(owner, handle.remove)  # a deleted wrapper leaves no hook that would average or warn
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
