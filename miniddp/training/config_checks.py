"""The two TrainingConfig fields that name another library's values: a compile backend, checkpoint keywords.

What
    ``check_compile_backend(name)`` refuses a ``torch_compile_backend`` that ``torch.compile`` does not
    know, listing the ones it does. ``checkpoint_kwargs(value)`` turns ``gradient_checkpointing_kwargs``
    (a dict, or JSON text from the command line) into a dict of ``torch.utils.checkpoint.checkpoint``'s
    keywords, each of its type: the booleans ``use_reentrant``, ``preserve_rng_state``, ``debug``,
    ``early_stop``, ``determinism_check`` one of ``"default"`` / ``"none"``, and ``context_fn`` a
    callable (so never from JSON). A key written twice in the JSON is refused, not resolved to the last.

Why
    Both values are read only at the first training step: an unknown backend surfaced there as a
    54-line dynamo traceback, an unknown keyword as 62 lines ending in the model's forward (checkpoint
    passes keywords it does not take on to the function it checkpoints), and ``"use_reentrant": "yes"``
    was simply true. Refused with the config, they cost one line and no start-up.

    Asking torch for its backends (``torch._dynamo.list_backends``) imports dynamo, which costs
    seconds. So the names every supported torch registers, and the names packages register through
    the ``torch_dynamo_backends`` entry points (where torch looks for them too), are accepted without
    it; only another name (a typo, a backend registered in Python) pays for torch's own answer.

How torch and Hugging Face differ
    ``TrainingArguments`` checks neither field: Transformers passes the backend to ``torch.compile``
    and the keywords to ``functools.partial(checkpoint, **kwargs)`` at ``gradient_checkpointing_enable()``.
    torch checks the backend name at the first call of the compiled model, ``determinism_check`` at
    the first checkpointed forward, and takes any truthy ``use_reentrant``.
"""

from __future__ import annotations

import inspect
import json
from importlib.metadata import entry_points

# Registered by every torch this project supports (2.4 and later): accepted without importing dynamo.
COMMON_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")
# torch.utils.checkpoint.checkpoint's keywords and the type of each (preserve_rng_state is read from
# its **kwargs); tests/test_config.py checks this table against the installed torch's signature.
CHECKPOINT_BOOLEANS = ("use_reentrant", "preserve_rng_state", "debug", "early_stop")
DETERMINISM_CHECKS = ("default", "none")  # torch.utils.checkpoint's _allowed_determinism_checks_to_fns


def torch_compile_backends(default_only: bool = False) -> list[str]:
    """torch's own list of ``torch.compile`` backend names (imports ``torch._dynamo``: seconds, once)."""
    import torch._dynamo  # noqa: PLC0415 - only for a name that is neither common nor an entry point

    return torch._dynamo.list_backends() if default_only else torch._dynamo.list_backends(exclude_tags=())


def check_compile_backend(name) -> None:
    """A ValueError naming ``torch_compile_backend`` and the valid names, unless ``torch.compile`` knows ``name``."""
    if name is None:
        return
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"torch_compile_backend={name!r} must name a torch.compile backend, e.g. inductor or "
                         "aot_eager, or be None (inductor)")
    if name in COMMON_BACKENDS or name in entry_points(group="torch_dynamo_backends").names:
        return
    if name not in torch_compile_backends():
        shown = dict.fromkeys([*COMMON_BACKENDS, *torch_compile_backends(default_only=True)])
        raise ValueError(f"torch_compile_backend={name!r} is not a torch.compile backend: one of {', '.join(shown)} "
                         "(every name: torch._dynamo.list_backends(exclude_tags=())), or None for inductor")


def checkpoint_keywords() -> dict[str, str]:
    """Each keyword this torch's ``checkpoint`` takes -> what its value must be (for the messages)."""
    from torch.utils.checkpoint import checkpoint  # noqa: PLC0415 - imported by torch itself already

    taken = {p.name for p in inspect.signature(checkpoint).parameters.values() if p.kind == p.KEYWORD_ONLY}
    wanted = {**{name: "true or false" for name in CHECKPOINT_BOOLEANS},
              "determinism_check": " or ".join(f'"{v}"' for v in DETERMINISM_CHECKS),
              "context_fn": "a callable (given in Python: JSON cannot hold one)"}
    return {name: wanted[name] for name in wanted if name in taken | {"preserve_rng_state"}}


def _no_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"gradient_checkpointing_kwargs has the key {key!r} twice: write it once")
        seen[key] = value
    return seen


def checkpoint_kwargs(value) -> dict | None:
    """``gradient_checkpointing_kwargs`` as a dict of ``checkpoint``'s keywords: given as one, or as JSON text."""
    example = 'e.g. {"use_reentrant": false}'
    if isinstance(value, str):
        try:
            value = json.loads(value, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as err:
            raise ValueError(f"gradient_checkpointing_kwargs={value!r} is not JSON ({err.msg}): write it as "
                             '{"use_reentrant": true}') from None
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"gradient_checkpointing_kwargs={value!r} must be a dict of torch.utils.checkpoint's "
                         f"keywords, {example}")
    allowed = checkpoint_keywords()
    for key, given in value.items():
        if key not in allowed:
            raise ValueError(f"gradient_checkpointing_kwargs: torch.utils.checkpoint.checkpoint takes no keyword "
                             f"{key!r}; it takes {', '.join(allowed)}")
        if key in CHECKPOINT_BOOLEANS:
            ok = isinstance(given, bool)
        elif key == "determinism_check":
            ok = given in DETERMINISM_CHECKS
        else:
            ok = callable(given)
        if not ok:
            raise ValueError(f"gradient_checkpointing_kwargs: {key}={given!r} must be {allowed[key]}")
    if value.get("use_reentrant") is True and (value.get("debug") or "context_fn" in value):
        raise ValueError("gradient_checkpointing_kwargs: debug and context_fn need use_reentrant=false "
                         "(torch.utils.checkpoint refuses them with reentrant checkpointing)")
    return dict(value)
