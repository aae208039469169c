"""Docs that cannot drift: every signature the docs show for the public API is the code's signature.

The fenced code blocks of docs/*.md, and of the "Public API" section of the design card (../shared/DESIGN.md,
when this checkout has one beside it), show the public API as calls: ``miniddp.X(a, b=1, *, c=None) -> T``, on a
line of its own, and methods in the comments below a class, ``# .join(enable=True)``. Each is compared with
``inspect.signature`` of the object it names: every parameter shown exists; one shown positionally has that
position; one after a bare ``*`` is keyword-only; a default shown is the code's default. ``...`` means "more not
shown": the positions after it are not compared, nor those after ``name=...`` (a call by keyword). A comment's
method is a call: a bare name there is the argument's value (``.set_epoch(e)``: its position is compared, not its
name) and ``name=value`` a keyword with its default. ``miniddp.SomeError(RuntimeError)`` shows a base class. The
calls in the pages' Python examples must bind to the code too, and docs/trainer.md's flag defaults are
``TrainingConfig``'s.

What the design card promises for later (NOT_YET) is skipped while the code lacks it, and fails the test once
the code has it, so that the list only shrinks.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DESIGN = Path(__file__).parents[2] / "shared" / "DESIGN.md"

# What the design card shows and the code does not have yet: (name, parameter), or (name, None) for a name
# that does not exist. Each still fails its comparison; once it passes, the test says to delete the entry.
NOT_YET = {
    # the card shows torch 2.12's default; the constructor has torch 2.13's (None: True, deprecated for
    # forward_sync_buffers), as its whole signature must equal torch's (tests/test_torch_surface.py)
    ("miniddp.DistributedDataParallel", "broadcast_buffers"): "the card's default True is torch 2.12's; 2.13's is None",
}

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<info>[^\n]*)\n"
                   r"(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$", re.S | re.M)
PROSE_GAP = re.compile(r"\.\.\.(?=\w)[^,()]*?\.\.\.")  # `...the rest of torch's keywords...`: one `...`
MENTION = re.compile(r"(?<![\w.)\]])\.(\w+)\(")  # `.join(` in a comment, not `torch.distributed._f(`
PLACEHOLDER = object()  # `name=...`: passed by keyword, its value not shown
NOT_SHOWN = object()  # a default that is not a literal (`args=TrainingConfig(...)`): not compared


@dataclass(frozen=True)
class Item:
    """One parameter as a doc shows it."""

    name: str | None  # None: an argument's value (a comment's `.set_epoch(e)`), its name not shown
    kind: str  # "positional" (at `index`), "keyword" (passable by keyword), "keyword_only", "var_keyword"
    index: int | None = None
    default: object = NOT_SHOWN


@dataclass(frozen=True)
class Shown:
    """A name a doc shows, with its parameters when it shows a call (`items` None: the name alone)."""

    target: str
    where: str
    items: tuple[Item, ...] | None = None


@dataclass(frozen=True)
class Problem:
    target: str
    param: str | None  # None: the name itself
    message: str

    @property
    def key(self):
        return (self.target, self.param)


def _close(text: str, start: int, quotes: bool = True) -> int:
    """The index of the bracket that closes the one at ``text[start]`` (-1 when it is not closed)."""
    depth, quote = 0, None
    for i in range(start, len(text)):
        c = text[i]
        if quote:
            quote = None if c == quote else quote
        elif quotes and c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _split(args: str) -> list[str]:
    parts, depth, quote, last = [], 0, None, 0
    for i, c in enumerate(args):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(args[last:i])
            last = i + 1
    return [p.strip() for p in [*parts, args[last:]] if p.strip()]


def _value(expr: str):
    if expr.strip() == "...":
        return PLACEHOLDER
    try:
        return ast.literal_eval(expr.strip())
    except (ValueError, SyntaxError):
        return NOT_SHOWN


def parse_items(args: str, mention: bool = False) -> tuple[Item, ...]:
    """The parameters shown between a call's parentheses (`mention`: a method in a comment)."""
    items, index, in_order, kw_only = [], 0, True, False
    for part in _split(PROSE_GAP.sub("...", args)):
        keyword = re.fullmatch(r"(\w+)\s*=(?!=)\s*(.+)", part, re.S)
        if part == "*" or (part.startswith("*") and not part.startswith("**")):
            in_order, kw_only = False, True
        elif part == "...":
            in_order = False  # more not shown: the positions after it are unknown
        elif part.startswith("**"):
            items.append(Item(part[2:].strip(), "var_keyword"))
        elif keyword:
            default = _value(keyword[2])
            if default is PLACEHOLDER or mention:
                in_order = False  # `model=...`, a comment's `.join(enable=True)`: by keyword, in no order
            kind = "keyword_only" if kw_only else "positional" if in_order else "keyword"
            items.append(Item(keyword[1], kind, index if kind == "positional" else None, default))
            index += 1
        elif in_order:
            shows_name = part.isidentifier() and not mention
            items.append(Item(part if shows_name else None, "positional", index))
            index += 1
    return tuple(items)


def _statement(code: str, where: str) -> list[Shown]:
    """`miniddp.X(...) -> T`, `miniddp.m.f / g / h`, `miniddp.m.C(...) + g`: what the line shows."""
    code = PROSE_GAP.sub("...", code)
    head = re.match(r"\s*(miniddp(?:\.\w+)+)\s*", code)
    target, rest, items = head[1], code[head.end():], None
    if rest.startswith("("):
        end = _close(rest, 0)
        items, rest = parse_items(rest[1:end]), rest[end + 1:]
    shown = [Shown(target, where, items)]
    module = target.rsplit(".", 1)[0]
    for name in re.findall(r"\s*[/+]\s*(\w+)", re.match(r"(?:\s*[/+]\s*\w+)*", rest)[0]):
        shown.append(Shown(f"{module}.{name}", where))  # the names beside the first, in its module
    return shown


def _comment(line: str) -> tuple[str, str]:
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#":
            return line[:i], line[i + 1:]
    return line, ""


def parse_signatures(text: str, source: str, line_offset: int = 0) -> list[Shown]:
    """Every signature shown in the fenced code blocks of a Markdown text (whose first line is
    ``line_offset + 1`` of `source`)."""
    shown = []
    for block in FENCE.finditer(text):
        if block["info"].strip().startswith("mermaid"):
            continue
        first = line_offset + text.count("\n", 0, block.start("body")) + 1
        lines, owner, i = block["body"].splitlines(), None, 0
        while i < len(lines):
            code, comments, start = *_comment(PROSE_GAP.sub("...", lines[i])), i
            if code.strip().startswith("miniddp."):
                while code.count("(") > code.count(")") and i + 1 < len(lines):  # a call over several lines
                    i += 1
                    more, comment = _comment(PROSE_GAP.sub("...", lines[i]))
                    code, comments = code + " " + more.strip(), comments + "\n" + comment
                found = _statement(code, f"{source}:{first + start}")
                shown += found
                if found[0].items is not None and found[0].target.rsplit(".", 1)[1][:1].isupper():
                    owner = found[0].target  # a class: the comments below show its methods
            for mention in MENTION.finditer(comments):
                end = _close(comments, mention.end() - 1, quotes=False)
                if owner and end > 0:
                    args = comments[mention.end():end]
                    shown.append(Shown(f"{owner}.{mention[1]}", f"{source}:{first + i}", parse_items(args, True)))
            i += 1
    return shown


def resolve(dotted: str):
    """The object a dotted name names (``miniddp.comm_hooks.X``, ``miniddp.C.method``), and whether it is a
    method reached through its class (its first parameter is then `self`). LookupError when it does not exist."""
    parts = dotted.split(".")
    obj, parent = importlib.import_module(parts[0]), None
    for i, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj, parent = getattr(obj, part), obj
        elif inspect.ismodule(obj):
            try:
                obj, parent = importlib.import_module(".".join(parts[: i + 1])), obj
            except ModuleNotFoundError:
                raise LookupError(f"{dotted}: {'.'.join(parts[:i])} has no {part!r}") from None
        else:
            raise LookupError(f"{dotted}: {'.'.join(parts[:i])} has no attribute {part!r}")
    method = inspect.isclass(parent) and inspect.isfunction(inspect.getattr_static(parent, parts[-1]))
    return obj, method


def _signature(obj, method: bool) -> inspect.Signature:
    sig = inspect.signature(obj)
    return sig.replace(parameters=list(sig.parameters.values())[1:]) if method else sig


def _same(shown, actual) -> bool:
    return shown == actual and isinstance(shown, bool) == isinstance(actual, bool)


def check(shown: Shown, obj=None) -> list[Problem]:
    """What the code lacks of what `shown` shows ([] when it has all of it); `obj`: compare with it instead."""
    method = False
    if obj is None:
        try:
            obj, method = resolve(shown.target)
        except LookupError as e:
            return [Problem(shown.target, None, f"{shown.where}: {e}")]
    if shown.items is None:
        return []
    names = [it.name for it in shown.items if it.kind == "positional"]
    if inspect.isclass(obj) and issubclass(obj, BaseException) and names and all(
            hasattr(builtins, n or "") for n in names):  # `miniddp.SomeError(RuntimeError)`: its base classes
        return [Problem(shown.target, n, f"{shown.where}: {shown.target} is not a subclass of {n}")
                for n in names if getattr(builtins, n) not in obj.__mro__]
    params = _signature(obj, method).parameters
    ordered = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    problems = []

    def fail(item, message):
        problems.append(Problem(shown.target, item.name, f"{shown.where}: {shown.target}: {message}"))

    for it in shown.items:
        if it.kind == "var_keyword":
            if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                fail(it, f"takes no **{it.name}")
            continue
        if it.kind == "positional":
            param = ordered[it.index] if it.index < len(ordered) else None
            if it.name is not None and (param is None or param.name != it.name):
                has = f"a {params[it.name].kind.description} parameter" if it.name in params else "no parameter"
                fail(it, f"{it.name!r} is shown as positional argument {it.index + 1}; the code has {has} {it.name!r}")
                continue
            if param is None and not any(p.kind == p.VAR_POSITIONAL for p in params.values()):
                fail(it, f"takes {len(ordered)} positional argument(s); the docs pass one at {it.index + 1}")
                continue
        else:
            param = params.get(it.name)
            if param is None:
                fail(it, f"has no parameter {it.name!r}")
                continue
            allowed = (param.KEYWORD_ONLY,) if it.kind == "keyword_only" else (
                param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
            if param.kind not in allowed:
                fail(it, f"{it.name!r} is shown {it.kind.replace('_', '-')}; the code has it {param.kind.description}")
                continue
        if param is not None and it.default not in (NOT_SHOWN, PLACEHOLDER) and not _same(it.default, param.default):
            code = "no default" if param.default is param.empty else f"default {param.default!r}"
            fail(it, f"{param.name!r} is shown with default {it.default!r}; the code has {code}")
    return problems


def doc_signatures() -> list[Shown]:
    return [s for page in sorted((ROOT / "docs").glob("*.md"))
            for s in parse_signatures(page.read_text(), page.relative_to(ROOT).as_posix())]


def design_signatures() -> list[Shown]:
    """The design card's "Public API" section (it ends at the next second-level heading)."""
    text = DESIGN.read_text()
    section = re.search(r"^## Public API.*?(?=^## )", text, re.S | re.M)
    return parse_signatures(section[0], "DESIGN.md", text.count("\n", 0, section.start()))


def _covered(problem: Problem, not_yet) -> bool:
    """NOT_YET names it, or names a missing name above it (a method of a class not built yet)."""
    return problem.key in not_yet or any(
        param is None and problem.target.startswith(name + ".") for name, param in not_yet)


def unexpected(shown: list[Shown], not_yet=NOT_YET) -> list[str]:
    return [p.message for s in shown for p in check(s) if not _covered(p, not_yet)]


def _exists(name: str) -> bool:
    try:
        resolve(name)
    except LookupError:
        return False
    return True


def not_yet_left_over(shown: list[Shown] | None, not_yet=NOT_YET) -> list[str]:
    """The NOT_YET entries that should go: the code has them as shown, or no doc shows them any more. `shown`:
    every signature of the docs and the design card; None without the design card: only its names are checked."""
    if shown is None:
        return [f"{name}: exists: delete it from NOT_YET" for name, param in not_yet if param is None and _exists(name)]
    keys = {(s.target, None) for s in shown} | {(s.target, it.name) for s in shown for it in s.items or ()}
    failing = {p.key for s in shown for p in check(s)}
    return [f"{key}: " + ("implemented as shown: delete it from NOT_YET" if key in keys else "shown nowhere")
            for key in not_yet if key not in failing]


def test_the_docs_show_the_code_s_signatures():
    shown = doc_signatures()
    assert {"miniddp.DistributedDataParallel", "miniddp.DistributedDataParallel.join"} <= {s.target for s in shown}
    problems = unexpected(shown)
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(not DESIGN.exists(), reason=f"no design card at {DESIGN} (a clean clone has none)")
def test_the_design_card_s_public_api_is_the_code_s():
    shown = design_signatures()
    assert {"miniddp.select_backend", "miniddp.Trainer", "miniddp.comm_hooks.powerSGD_hook",
            "miniddp.DistributedDataParallel.join", "miniddp.drop_in.install"} <= {s.target for s in shown}
    problems = unexpected(shown)
    assert not problems, "\n".join(problems)


def test_not_yet_holds_only_what_the_code_still_lacks():
    left_over = not_yet_left_over(doc_signatures() + design_signatures() if DESIGN.exists() else None)
    assert not left_over, "\n".join(left_over)


def test_the_calls_in_the_docs_examples_bind_to_the_code():
    """`ddp = miniddp.DistributedDataParallel(model, bucket_cap_mb=100)`, `ddp.join()`: names and arity."""
    problems, calls = [], 0
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        for block in FENCE.finditer(text):
            if not block["info"].strip().startswith(("python", "py")):
                continue
            try:
                tree = ast.parse(textwrap.dedent(block["body"]))
            except SyntaxError:  # a signature (`*`, `...prose...`), not a program
                continue
            line = text.count("\n", 0, block.start()) + 2
            made = {a.targets[0].id: ast.unparse(a.value.func) for a in ast.walk(tree) if isinstance(a, ast.Assign)
                    and isinstance(a.targets[0], ast.Name) and isinstance(a.value, ast.Call)
                    and ast.unparse(a.value.func).rsplit(".", 1)[-1][:1].isupper()}  # an instance of a class
            for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
                name = ast.unparse(call.func)
                owner = name.split(".")[0]
                target = name if owner == "miniddp" else made.get(owner, "") + name[len(owner):]
                if not target.startswith("miniddp.") or (owner != "miniddp" and "." not in name):
                    continue
                if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
                    continue
                calls += 1
                try:
                    obj, method = resolve(target)
                    _signature(obj, method).bind(*call.args, **{k.arg: k.value for k in call.keywords})
                except (LookupError, TypeError) as e:
                    problems.append(f"docs/{page.name}:{line + call.lineno - 1}: {ast.unparse(call)}: {e}")
    assert calls > 0
    assert not problems, "\n".join(problems)


def _shown_default(cell: str):
    """A table's default cell: `` `auto` `` a string, ``none (...)`` None, ``true``, ``1800``."""
    if cell.startswith("`"):
        return cell.split("`")[1]
    word = cell.split(" (")[0].strip()
    return {"none": None, "true": True, "false": False}.get(word, NOT_SHOWN if not word else _value(word))


def test_the_trainer_page_s_flag_defaults_are_training_config_s():
    """docs/trainer.md's table `| `--flag` | default | DDP meaning |`: each default is the field's."""
    import dataclasses

    import miniddp

    fields = {f.name: f.default for f in dataclasses.fields(miniddp.TrainingConfig)}
    rows = re.findall(r"^\| `--(\w+)` \| ([^|]*) \|", (ROOT / "docs" / "trainer.md").read_text(), re.M)
    assert len(rows) >= 10
    wrong = [f"--{flag}: shown {cell.strip()} ({_shown_default(cell.strip())!r}), TrainingConfig has "
             f"{fields.get(flag, 'no such field')!r}"
             for flag, cell in rows if flag not in fields or not _same(_shown_default(cell.strip()), fields[flag])]
    assert not wrong, "\n".join(wrong)


def _stand_in(module, device_ids=None, *, process_group=None, bucket_cap_mb=None, tracer=None):
    """The shape of DistributedDataParallel's documented signature, to break one piece at a time."""


def test_the_comparison_fails_when_the_code_loses_what_the_docs_show(monkeypatch):
    [shown] = parse_signatures("```python\nminiddp.X(module, device_ids=None, *, process_group=None,\n"
                               "    bucket_cap_mb=None, tracer=None)\n```\n", "control")
    assert check(shown, _stand_in) == []

    def without_bucket_cap(module, device_ids=None, *, process_group=None, tracer=None): ...
    def other_default(module, device_ids=None, *, process_group=None, bucket_cap_mb=25, tracer=None): ...
    def positional(module, device_ids=None, process_group=None, bucket_cap_mb=None, tracer=None): ...
    def reordered(device_ids=None, module=None, *, process_group=None, bucket_cap_mb=None, tracer=None): ...

    assert [p.param for p in check(shown, without_bucket_cap)] == ["bucket_cap_mb"]
    assert [p.param for p in check(shown, other_default)] == ["bucket_cap_mb"]
    assert [p.param for p in check(shown, positional)] == ["process_group", "bucket_cap_mb", "tracer"]
    assert [p.param for p in check(shown, reordered)] == ["module", "device_ids"]

    # the real pipeline: docs/ddp.md's signature against DistributedDataParallel without its last positional
    # parameter (one before it would move every later one, and each would be named)
    import miniddp

    ddp = miniddp.DistributedDataParallel
    sig = inspect.signature(ddp)
    monkeypatch.setattr(ddp, "__signature__", sig.replace(
        parameters=[p for p in sig.parameters.values() if p.name != "forward_sync_buffers"]), raising=False)
    page = [s for s in doc_signatures() if s.target == "miniddp.DistributedDataParallel" and s.items]
    assert page and {p.param for s in page for p in check(s)} == {"forward_sync_buffers"}


def test_a_not_yet_entry_that_the_code_has_or_no_doc_shows_must_go():
    shown = parse_signatures("```python\nminiddp.DistributedDataParallel(module, *, tracer=None)\n```\n", "control")
    assert not_yet_left_over(shown, {("miniddp.DistributedDataParallel", "tracer"): "built"}) != []
    assert not_yet_left_over(shown, {("miniddp.NoSuchName", None): "later"}) != []
    assert not_yet_left_over(None, {("miniddp.NoSuchName", None): "later"}) == []
    assert not_yet_left_over(None, {("miniddp.Trainer", None): "built"}) != []
    missing = parse_signatures("```\nminiddp.NoSuchName(x)\n```\n", "control")
    assert not_yet_left_over(missing, {("miniddp.NoSuchName", None): "later"}) == []


def test_the_parser_reads_the_forms_the_docs_use():
    text = ("```python\nminiddp.C(module, a=None, b=1_000, ...the rest of torch 2.13's keywords..., *, t=None) -> x\n"
            "    # .join(enable=True), .set_epoch(e); equal to torch.distributed._f(tensors)[0]\n"
            "miniddp.comm_hooks.f / g\nminiddp.comm_hooks.S(pg, r=1, ...) + h   # as torch's\n"
            "miniddp.T(model=..., args=Config(...), e=None)\nminiddp.E(RuntimeError)\n```\n")
    shown = {s.target: s.items for s in parse_signatures(text, "control")}
    assert shown == {
        "miniddp.C": (Item("module", "positional", 0), Item("a", "positional", 1, None),
                      Item("b", "positional", 2, 1000), Item("t", "keyword_only", None, None)),
        "miniddp.C.join": (Item("enable", "keyword", None, True),),
        "miniddp.C.set_epoch": (Item(None, "positional", 0),),
        "miniddp.comm_hooks.f": None, "miniddp.comm_hooks.g": None, "miniddp.comm_hooks.h": None,
        "miniddp.comm_hooks.S": (Item("pg", "positional", 0), Item("r", "positional", 1, 1)),
        "miniddp.T": (Item("model", "keyword", None, PLACEHOLDER), Item("args", "keyword", None, NOT_SHOWN),
                      Item("e", "keyword", None, None)),
        "miniddp.E": (Item("RuntimeError", "positional", 0),),
    }
