"""The sandbox a chat template renders in: Jinja2's immutable sandbox (no attribute outside it, no mutation of
the messages) with what one render may cost bounded, since a template comes with a model file from anyone.

- Work: every loop iteration, macro body, call, filter and intercepted operator is a step; a render may take
  MAX_STEPS steps and MAX_SECONDS of its thread's CPU time (checked every 256 steps), so nested loops end.
- Size: no string or list a template makes may pass the render's size limit (1 MiB plus four times the text of
  the messages), checked *before* the value is built: `*`, `+`, `~`, `%`, `**`, `str.format`/`replace`/`join`/
  `expandtabs`, the filters that can grow text (string, pprint, tojson, indent, wordwrap, center, join, replace,
  format, escape, xmlattr, urlize), a value written out or stored in a namespace (its text length is estimated by
  walking it, so `{{ [big] * 10000 }}` is refused before str() builds it); integer arguments of calls and filters
  (widths, indents, counts) are at most MAX_ARGUMENT, like Jinja's own `range`, tojson's indent at most
  MAX_JSON_INDENT, a format width may not come from another field, and `lipsum` writes at most MAX_LIPSUM_WORDS
  words; the output, literal text repeated by loops and macros included, is bounded by the same limit.
- Recursion ends at Python's recursion limit (the render reports it).
A bound crossed is a jinja2 SecurityError, which the chat formatter reports like any template failure. What one
operation does between two checks is still the interpreter's (a C loop cannot be interrupted): the renderer's process
(template_pool.py) bounds memory and time from outside as well.
"""

from __future__ import annotations

import functools
import re
import string
import threading
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import jinja2.nodes as nodes
from jinja2 import Environment
from jinja2.nodes import EvalContext
from jinja2.runtime import Context, Undefined
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace, generate_lorem_ipsum
from jinja2.visitor import NodeTransformer

MAX_STEPS = 1_000_000
MAX_SECONDS = 1.0
MAX_ARGUMENT = MAX_RANGE
MAX_JSON_INDENT = 16
MAX_LIPSUM_WORDS = 10_000
BASE_LIMIT = 1 << 20
_TICK = "__kobold_tick"
_CONCAT = "__kobold_concat"
_WIDTH = re.compile(r"\d+")
_PERCENT = re.compile(r"%(?:\([^)]*\))?([#0\- +]*[\d*]*(?:\.[\d*]*)?)[a-zA-Z%]")


class Budget:
    """What one render may still spend: steps, seconds, and the size of any value and of the output."""

    def __init__(self, input_chars: int) -> None:
        self.limit = BASE_LIMIT + 4 * input_chars
        self.steps = 0
        self.output = 0
        self.deadline = time.thread_time() + MAX_SECONDS

    def step(self, chars: int = 0) -> None:
        self.steps += 1
        self.output += chars
        if self.steps > MAX_STEPS:
            raise SecurityError(f"the chat template ran more than {MAX_STEPS} steps")
        if self.output > self.limit:
            raise SecurityError(f"the chat template's output passed {self.limit} characters")
        if self.steps % 256 == 0 and time.thread_time() > self.deadline:
            raise SecurityError(f"the chat template ran longer than {MAX_SECONDS} s of CPU time")

    def size(self, n: int, what: str) -> None:
        if n > self.limit:
            raise SecurityError(f"the chat template made {what} of size {n} (at most {self.limit})")

    def text(self, value: Any, what: str, indent: int = 0) -> int:
        """The length of str(value) (or of its JSON with `indent`), refused past the limit before it is built."""
        n = text_size(value, self.limit, indent)
        self.size(n, what)
        return n


_active = threading.local()


def _budget() -> Budget:
    budget = getattr(_active, "budget", None)
    return budget if budget is not None else Budget(0)


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _quoted(text: str) -> int:
    """The length of repr(text) (or its JSON), without building it where the text is printable."""
    if text.isprintable():
        return len(text) + 2 + text.count("\\") + text.count("'") + text.count('"')
    return len(repr(text)) + 2 * len(text)  # JSON escapes a control character in six characters, repr in four


def text_size(value: Any, limit: int, indent: int = 0) -> int:
    """An upper estimate of len(str(value)) (nested strings quoted, `indent` spaces per level and a separator per
    item, as json.dumps with that indent writes them), walking containers without building their text; the walk
    stops once the estimate passes `limit` (each item counts at least one character, so it is bounded too)."""
    if isinstance(value, str):
        return len(value)
    total = 0
    stack: List[Tuple[Iterator[Any], int]] = [(iter((value,)), 0)]
    while stack and total <= limit:
        items, depth = stack[-1]
        item = next(items, _END)
        if item is _END:
            stack.pop()
            continue
        total += 2 + indent * depth
        if isinstance(item, str):
            total += _quoted(item)
        elif isinstance(item, (list, tuple, set, frozenset, range)):
            stack.append((iter(item), depth + 1))
        elif isinstance(item, dict):
            stack.append((iter([x for kv in item.items() for x in kv]), depth + 1))
        elif isinstance(item, Namespace):
            stack.append((iter([x for kv in object.__getattribute__(item, "_Namespace__attrs").items()
                                for x in kv]), depth + 1))
        elif isinstance(item, (type({}.keys()), type({}.values()), type({}.items()))):
            stack.append((iter(list(item)), depth + 1))
        elif isinstance(item, Undefined):
            continue
        elif isinstance(item, int) and not isinstance(item, bool):
            total += item.bit_length() // 3 + 2
        else:
            total += len(str(item))  # numbers, None, macros, loops: short texts
    return total


_END = object()


def _check_arguments(args: Iterable[Any]) -> None:
    for value in args:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_ARGUMENT:
            raise SecurityError(f"the chat template passed {value} to a call (at most {MAX_ARGUMENT})")


def _check_format(text: str, percent: bool, args: Iterable[Any] = ()) -> None:
    """A format string (%-style or str.format) may not ask for a width or precision above MAX_ARGUMENT nor take one
    from another field; its result (each field at most the longest argument or width) must fit the limit."""
    if percent:
        specs = [m.group(1) or "" for m in _PERCENT.finditer(text)]
    else:
        try:
            specs = [spec or "" for _, field, spec, _ in string.Formatter().parse(text) if field is not None]
        except ValueError:
            return  # str.format raises the same error itself
    widest = 0
    for spec in specs:
        if ("*" in spec and percent) or "{" in spec:
            raise SecurityError("the chat template takes a format width from its arguments")
        for digits in _WIDTH.findall(spec):
            if len(digits) > 6 or int(digits) > MAX_ARGUMENT:
                raise SecurityError(f"the chat template formats with a width of {digits}")
            widest = max(widest, int(digits))
    if specs:
        budget = _budget()
        longest = max([budget.text(a, "a formatted value") for a in args] + [widest])
        budget.size(len(text) + len(specs) * longest, "a formatted string")


def _check_replace(text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        grows = (text.count(old) if old else len(text) + 1) * len(new)
        _budget().size(len(text) + grows, "a replaced string")


def _check_join(items: List[Any], separator: Any) -> None:
    budget = _budget()
    sep = len(separator) if isinstance(separator, str) else 0
    total = 0
    for item in items:
        total += text_size(item, budget.limit) + sep
        budget.size(total, "a joined string")


def _filter_size(name: str, values: List[Any], kwargs: Dict[str, Any]) -> None:
    """Refuse, before it runs, a filter whose result would pass the limit (values: the filter's own arguments)."""
    budget = _budget()
    value, rest = values[0], values[1:]

    def arg(i: int, key: str, default: Any) -> Any:
        return rest[i] if len(rest) > i else kwargs.get(key, default)

    if name in ("string", "e", "escape", "forceescape", "xmlattr", "urlize", "center", "indent", "wordwrap",
                "pprint", "tojson"):
        indent = arg(0, "indent", None) if name == "tojson" else (1 if name == "pprint" else 0)
        if not isinstance(indent, int) or isinstance(indent, bool):
            indent = len(indent) if isinstance(indent, str) else 0
        if indent > MAX_JSON_INDENT and name == "tojson":
            raise SecurityError(f"the chat template asked tojson for an indent of {indent} (at most "
                                f"{MAX_JSON_INDENT})")
        n = budget.text(value, f"the input of the {name} filter", indent)
        text = value if isinstance(value, str) else ""
        grown = {"e": 6 * n, "escape": 6 * n, "forceescape": 6 * n, "xmlattr": 6 * n, "urlize": 8 * n}.get(name, n)
        if name == "center":
            width = arg(0, "width", 80)
            grown = max(n, width if isinstance(width, int) else 0)
        elif name == "indent":
            width = arg(0, "width", 4)
            grown = n + (text.count("\n") + 1) * (len(width) if isinstance(width, str) else max(int(width), 0))
        elif name == "wordwrap":
            width = max(1, int(arg(0, "width", 79)))
            wrap = arg(2, "wrapstring", None)
            pieces = n // width + text.count(" ") + text.count("\n") + 1
            grown = n + pieces * (len(wrap) if isinstance(wrap, str) else 2)
        budget.size(grown, f"the result of the {name} filter")
    elif name == "join" and not isinstance(value, str) and arg(1, "attribute", None) is None:
        _check_join(value, arg(0, "d", ""))
    elif name == "replace" and len(rest) >= 2:
        _check_replace(value, rest[0], rest[1])
    elif name == "format" and isinstance(value, str):
        _check_format(value, True, list(rest) + list(kwargs.values()))


def _guarded_filter(name: str, func: Any) -> Any:
    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        values = list(args)
        first = next((i for i, a in enumerate(values) if not isinstance(a, (Context, EvalContext, Environment))),
                     len(values))
        _check_arguments(values[first + 1:] + list(kwargs.values()))
        if first < len(values):
            if name == "join" and not isinstance(values[first], str):
                values[first] = list(values[first])
            _filter_size(name, values[first:], kwargs)
        out = func(*values, **kwargs)
        budget.size(_length(out), f"the result of the {name} filter")
        return out

    return guarded


class _GuardedFilters(dict):
    """The filter table: every filter, those set later included, runs through _guarded_filter."""

    def __init__(self, filters: Dict[str, Any]) -> None:
        super().__init__()
        for name, func in filters.items():
            self[name] = func

    def __setitem__(self, name: str, func: Any) -> None:
        super().__setitem__(name, _guarded_filter(name, func))


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment with the bounds above (see the module docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=_count_output, **options)
        self.filters = _GuardedFilters(self.filters)
        self.globals[_TICK] = _tick
        self.globals[_CONCAT] = _concat
        self.globals["lipsum"] = _lipsum
        self.globals["namespace"] = _BoundedNamespace

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.step()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(n, int) and isinstance(seq, (str, list, tuple)):
                    budget.size(len(seq) * max(n, 0), "a repeated sequence")
            if isinstance(left, int) and isinstance(right, int):
                _check_bits(abs(left).bit_length() + abs(right).bit_length())
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            budget.size(len(left) + len(right), "a joined sequence")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            _check_bits(abs(left).bit_length() * max(right, 0))
        elif operator == "%" and isinstance(left, str):
            args = right if isinstance(right, tuple) else (right,)
            _check_arguments(args)
            _check_format(left, True, list(right.values()) if isinstance(right, dict) else args)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's form)
        budget = _budget()
        budget.step()
        _check_arguments(list(args) + list(kwargs.values()))
        bound = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(bound, str):
            method = getattr(getattr(__obj, "__wrapped__", __obj), "__name__", "")
            if method == "format":
                _check_format(bound, False, list(args) + list(kwargs.values()))
            elif method == "format_map":
                _check_format(bound, False, list(args[0].values()) if args and isinstance(args[0], dict) else ())
            elif method == "replace" and len(args) >= 2:
                _check_replace(bound, args[0], args[1])
            elif method == "join" and args:
                args = (list(args[0]),) + tuple(args[1:])
                _check_join(args[0], bound)
            elif method == "expandtabs":
                tab = args[0] if args else kwargs.get("tabsize", 8)
                budget.size(len(bound) + bound.count("\t") * max(int(tab), 0), "an expanded string")
        out = super().call(__context, __obj, *args, **kwargs)
        budget.size(_length(out), "a call's result")
        return out

    def _parse(self, source: str, name: Optional[str], filename: Optional[str]) -> nodes.Template:
        """The parsed template with a tick at the start of every loop, macro and call-block body: it counts a step
        and the literal text that body writes each time it runs."""
        tree = _GuardConcat().visit(super()._parse(source, name, filename))
        for node in list(tree.find_all((nodes.For, nodes.Macro, nodes.CallBlock))):
            literal = sum(len(data.data) for data in _find(node.body, nodes.TemplateData))
            tick = nodes.Call(nodes.Name(_TICK, "load"), [nodes.Const(literal)], [], None, None)
            node.body.insert(0, nodes.Output([tick]))
        return tree


def _find(body: Iterable[nodes.Node], kind: Any) -> Iterable[Any]:
    for node in body:
        if isinstance(node, kind):
            yield node
        yield from node.find_all(kind)


def _check_bits(bits: int) -> None:
    if bits > 1 << 16:
        raise SecurityError(f"the chat template computed an integer of about {bits} bits")


def _tick(literal: int) -> str:
    _budget().step(literal)
    return ""


def _count_output(value: Any) -> Any:
    """Jinja's finalize: every value written out, measured before Jinja turns it into text."""
    budget = _budget()
    budget.step(budget.text(value, "a written value"))
    return value


class _GuardConcat(NodeTransformer):
    """`a ~ b ~ c` becomes a call of _concat, which measures the parts before joining them."""

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Call(nodes.Name(_CONCAT, "load"), node.nodes, [], None, None, lineno=node.lineno)


def _concat(*values: Any) -> str:
    budget = _budget()
    budget.step()
    total = 0
    for value in values:
        total += text_size(value, budget.limit)
        budget.size(total, "a joined string")
    return "".join(str(v) for v in values)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (Jinja's names)
    """Jinja's lipsum, refused past MAX_LIPSUM_WORDS words (n paragraphs of up to `max` words)."""
    _budget().step()
    if n * max > MAX_LIPSUM_WORDS or n < 0 or min < 1 or max < min:
        raise SecurityError(f"the chat template asked lipsum for {n} paragraphs of up to {max} words (at most "
                            f"{MAX_LIPSUM_WORDS} words)")
    return generate_lorem_ipsum(n, html, min, max)


class _BoundedNamespace(Namespace):
    """Jinja's namespace(); a value stored in it (`{% set ns.x = ... %}`) is measured like any other."""

    def __setitem__(self, name: str, value: Any) -> None:
        _budget().text(value, "a namespace value")
        Namespace.__setitem__(self, name, value)


def render_bounded(template: Any, input_chars: int, variables: Dict[str, Any]) -> str:
    """Render `template` (compiled by a BoundedSandbox) under a fresh budget for `input_chars` of messages."""
    previous = getattr(_active, "budget", None)
    _active.budget = Budget(input_chars)
    try:
        return template.render(**variables)
    finally:
        _active.budget = previous
