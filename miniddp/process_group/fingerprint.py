"""Fingerprints: one rank's view of one collective, and the line of user code that issued it.

What
    A ``Fingerprint`` holds what every rank must agree on (sequence number, op, reduce op and
    root, the dtypes and shapes of the tensors), who issued it (user code, or the part of
    miniddp named by ``issued_as("bucket 3 all-reduce")``) and where: ``call_site()`` walks
    the stack to the first frame outside torch and miniddp, the user's ``file.py:LINE``.

Why
    A desync message is only useful if it names the line to change. The collective runs deep
    inside torch, and a bucket's all-reduce inside autograd's backward: the user's line is on
    the stack, the part of miniddp in between is not named there, so miniddp labels its own.

How torch differs
    ``ProcessGroupWrapper`` compares a ``CollectiveFingerPrint``
    (``torch/csrc/distributed/c10d/ProcessGroupWrapper.cpp``): op, sequence number, input
    shapes, dtypes and devices; no reduce op, root, issuer or source line.
"""

from __future__ import annotations

import contextvars
import functools
import linecache
import os
import sys
from dataclasses import dataclass

import torch

# Not user code: frames under torch, or anywhere under this package, at whatever depth a module sits.
# Paths as the modules' __file__ spell them: the same strings as their code objects' co_filename.
_TORCH = os.path.dirname(torch.__file__) + os.sep
_PACKAGE = os.path.dirname(sys.modules[__name__.partition(".")[0]].__file__) + os.sep  # miniddp/
_LAYER = os.path.dirname(__file__) + os.sep  # miniddp/process_group/: the checking group's own frames
_ISSUER: contextvars.ContextVar[str | None] = contextvars.ContextVar("miniddp_issuer", default=None)
UNLABELLED = "miniddp"  # the issuer of a collective that miniddp issued outside any issued_as


def issued_as(label: str):
    """``with issued_as("bucket 3 all-reduce"):`` (or as a decorator): the collectives issued inside
    are reported under ``label`` in a desync message. The innermost label wins. Costs a context
    variable set when the detector is off."""
    return _Issuer(label)


class _Issuer:
    def __init__(self, label: str):
        self.label, self.tokens = label, []

    def __enter__(self):
        self.tokens.append(_ISSUER.set(self.label))
        return self

    def __exit__(self, *exc):
        _ISSUER.reset(self.tokens.pop())
        return False

    def __call__(self, fn):  # our own wrapper, not contextlib's: its frame is skipped as miniddp's
        @functools.wraps(fn)
        def issued(*args, **kwargs):
            token = _ISSUER.set(self.label)  # per call: threads never share it
            try:
                return fn(*args, **kwargs)
            finally:
                _ISSUER.reset(token)
        return issued


@dataclass(frozen=True)
class Fingerprint:
    """One rank's view of one collective (or of one end of a send/recv)."""

    seq: int  # position in the group's collective order (p2p: in its src->dst channel)
    op: str  # "all_reduce", "broadcast", "send"...
    args: str = ""  # reduce op and root: "SUM", "root=0"
    tensors: tuple = ()  # (dtype, shape) of each tensor every rank must agree on
    issuer: str = "user code"  # or the part of miniddp that issued it: "bucket 2 all-reduce"
    site: str = "?"  # the user's line, "train.py:40": reported, never compared
    code: str = ""  # that line's source text
    failed: str = ""  # this rank already raised this message: a peer that reads it raises it too

    @classmethod
    def here(cls, seq: int, op: str, args: str, tensors) -> Fingerprint:
        """The fingerprint of a collective being issued now: its tensors' specs, its issuer and site."""
        return cls(seq, op, args, tensor_specs(tensors), *call_site())

    def agreed(self) -> tuple:  # who issued it counts as user code or miniddp (join shadows the reducer)
        return self.seq, self.op, self.args, self.tensors, self.issuer == "user code"

    def __str__(self) -> str:
        shapes = ", ".join(f"{d}{list(s)}" for d, s in self.tensors[:4]) + (", ..." if len(self.tensors) > 4 else "")
        where = (f"user code at {self.site}: {self.code}" if self.issuer == "user code"
                 else f"{self.issuer} during {self.code or '?'} at {self.site}")
        return " ".join(x for x in (f"#{self.seq} {self.op}({self.args})", shapes, "from", where) if x)


# --8<-- [start:call_site]
def call_site() -> tuple[str, str, str]:
    """(issuer, ``"file.py:LINE"``, source text): the first frame outside torch and miniddp is
    the user's; the issuer is the innermost ``issued_as`` label (the reducer's hooks run inside
    ``loss.backward()``, so a bucket's all-reduce is reported at the backward line)."""
    frame, ours = sys._getframe(1), False
    while frame is not None and frame.f_code.co_filename.startswith((_TORCH, _PACKAGE)):
        name = frame.f_code.co_filename
        ours = ours or (name.startswith(_PACKAGE) and not name.startswith(_LAYER))
        frame = frame.f_back
    issuer = _ISSUER.get() or (UNLABELLED if ours else "user code")
    if frame is None:  # issued from C++ with no Python caller (e.g. on an autograd device thread)
        return issuer, "<no Python frame>", ""
    text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).split("  #")[0].strip()  # no comment
    return issuer, f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}", text
# --8<-- [end:call_site]


def tensor_specs(x) -> tuple:
    """((dtype, shape), ...) of every tensor in a nested list."""
    if isinstance(x, torch.Tensor):
        return ((str(x.dtype).removeprefix("torch."), tuple(x.shape)),)
    return tuple(t for item in x for t in tensor_specs(item)) if isinstance(x, (list, tuple)) else ()


def reduce_op_and_root(args, kwargs) -> str:
    """The reduce op and root in a collective's options: "SUM", "root=0"."""
    opts = [a for a in (*args, *kwargs.values()) if hasattr(a, "reduceOp") or hasattr(a, "rootRank")]
    ops = [getattr(getattr(o.reduceOp, "op", o.reduceOp), "name", "?") for o in opts if hasattr(o, "reduceOp")]
    return ",".join(ops + [f"root={o.rootRank}" for o in opts if hasattr(o, "rootRank")])
