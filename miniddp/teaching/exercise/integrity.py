"""What the check compares with, held still while the learner's code runs beside it.

What
    ``seal()`` records, in a process, before any learner's file is imported there, every attribute of
    the namespaces the spec compares with (``NAMESPACES``: ``torch.testing.assert_close`` and the
    machinery behind it, torch's and ``torch.Tensor``'s comparisons, the builtins, ``math``,
    ``operator``, pytest's ``approx``). ``replaced()`` names those rebound or deleted since, and
    ``restore()`` puts them back. ``swap.load`` seals before it imports a file and asks after it
    (the file then does not load); the check's plugin asks after each test case, and each rank
    after its function returns (the case fails, naming what was replaced: ``ComparisonReplacedError``).

Why
    The learner's code runs in the processes that compare its results: a file that set
    ``torch.testing.assert_close = lambda *a, **k: None`` made a wrong mean pass. It holds against
    replacing what the spec compares with; a file written to defeat this module itself (one that
    puts the original back before the check asks) would need the comparisons in a process the
    learner's code never ran in.

How others differ
    pytest and torch's own tests trust the code under test; nbgrader runs a notebook's hidden
    tests in the learner's own kernel, where the same replacement would pass them.
"""

from __future__ import annotations

import importlib

# a module (all its attributes), "module:Class" (the class's own) or "module:a,b" (those attributes only: torch
# rebinds some of its own when a submodule loads, e.g. torch._dynamo wraps torch.manual_seed); the classes of
# torch.testing._comparison (its Pair classes, which compare tensors and numbers) are sealed with their module
NAMESPACES = ("builtins", "math", "operator", "torch:Tensor", "torch.testing", "torch.testing._comparison",
              "torch:testing,equal,allclose,isclose,eq,ne,lt,le,gt,ge,all,any,isnan,isinf,isfinite,Tensor",
              "pytest", "_pytest.python_api")
_sealed: dict[tuple[str, str], tuple[object, object]] = {}  # (namespace, name) -> (the namespace, the value)


class ComparisonReplacedError(AssertionError):
    """The learner's code replaced something the spec compares with: the case fails, whatever it compared."""


def _namespaces():
    """(label, namespace, the names sealed there or None for all) for each of ``NAMESPACES`` importable here."""
    for spec in NAMESPACES:
        module_name, _, part = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # pytest, in a process started without it: nothing there compares with it
            continue
        if part[:1].isupper():
            yield f"{module_name}.{part}", getattr(module, part), None
        elif part:
            yield module_name, module, part.split(",")
        else:
            yield module_name, module, None
        if module_name == "torch.testing._comparison":
            for name, value in vars(module).items():
                if isinstance(value, type) and value.__module__ == module_name:
                    yield f"{module_name}.{name}", value, None


def seal() -> None:
    """Record the namespaces' attributes, once per process: the first call, before any learner's code."""
    if _sealed:
        return
    for label, namespace, names in _namespaces():
        for name, value in list(vars(namespace).items()):
            if names is None or name in names:
                _sealed[label, name] = (namespace, value)


_MISSING = object()


def replaced() -> list[str]:
    """The sealed attributes no longer the very objects sealed, as ``module.name``."""
    return [f"{label}.{name}" for (label, name), (namespace, value) in _sealed.items()
            if vars(namespace).get(name, _MISSING) is not value]


def restore() -> None:
    """Put back every sealed attribute that was replaced or deleted."""
    for (label, name), (namespace, value) in _sealed.items():
        if vars(namespace).get(name, _MISSING) is not value:
            setattr(namespace, name, value)


def check(where: str) -> None:
    """Raise ComparisonReplacedError naming what ``where`` replaced, after putting it back."""
    names = replaced()
    if names:
        restore()
        raise ComparisonReplacedError(f"{where} replaced {', '.join(names)}, which the spec compares with: "
                                      "a check cannot pass on comparisons the code under check changed")


def verified(fn):
    """``fn``, then ``check``: for a rank, whose result is sent before anything else could ask."""
    def run(*args, **kwargs):
        result = fn(*args, **kwargs)
        check(f"your code, called by {getattr(fn, '__name__', 'the spec')} in this rank,")
        return result
    return run
