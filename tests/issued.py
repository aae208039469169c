"""What a rank issues, seen at the dispatcher: the spec's count of collectives and messages.

Counting at the dispatcher, not by patching ``dist.all_reduce``, holds a learner to the contract
(how many collectives, how many elements sent) whatever primitive or import name they chose.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _numel(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel()
    return sum(_numel(t) for t in tensors) if isinstance(tensors, (list, tuple)) else 0


class Issued(TorchDispatchMode):
    """The c10d operations this rank issues, as the dispatcher sees them: ``(name, elements)`` each, the
    same whether the code called ``dist.all_reduce``, ``dist.send``, ``dist.isend``, ``batch_isend_irecv``
    with ``P2POp``s, a group's own method, or imported any of them by another name (torch's
    ``CommDebugMode`` counts collectives the same way). Only this thread's: a future's callback is not seen."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []  # ("allreduce_", 12), ("send", 400), ("recv_", 400)...

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            self.ops.append((func.name().split("::")[-1], _numel(args[0]) if args else 0))
        return func(*args, **(kwargs or {}))
