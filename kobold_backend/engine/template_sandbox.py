"""The sandbox a chat template renders in: Jinja2's immutable sandbox (no attribute outside it, no mutation of
the messages) with what one render may cost bounded, since a template comes with a model file from anyone.

- Work: every loop iteration, macro body, call, filter and intercepted operator is a step; a render may take
  MAX_STEPS steps and MAX_SECONDS of its thread's CPU time (checked every 256 steps), so nested loops end.
- Size: no string or list a template makes may pass the render's size limit (1 MiB plus four times the text of
  the messages), checked before `*`, `+`, `**` and `str.replace` build their result; integer arguments of calls
  and filters (widths, indents, counts) are at most MAX_ARGUMENT, like Jinja's own `range`; the output, literal text
  repeated by loops and macros included, is bounded by the same limit.
- Recursion ends at Python's recursion limit (the render reports it).
A bound crossed is a jinja2 SecurityError, which the chat formatter reports like any template failure.
"""

from __future__ import annotations

import functools
import re
import string
import threading
import time
from typing import Any, Dict, Iterable, Optional

import jinja2.nodes as nodes
from jinja2 import Environment
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment, SecurityError

MAX_STEPS = 1_000_000
MAX_SECONDS = 1.0
MAX_ARGUMENT = MAX_RANGE
BASE_LIMIT = 1 << 20
_TICK = "__kobold_tick"
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
            raise SecurityError(f"the chat template made {what} of {n} items (at most {self.limit})")


_active = threading.local()


def _budget() -> Budget:
    budget = getattr(_active, "budget", None)
    return budget if budget is not None else Budget(0)


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _check_arguments(args: Iterable[Any]) -> None:
    for value in args:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_ARGUMENT:
            raise SecurityError(f"the chat template passed {value} to a call (at most {MAX_ARGUMENT})")


def _check_format(text: str, percent: bool) -> None:
    """A format string (%-style or str.format) may not ask for a width or precision above MAX_ARGUMENT."""
    if percent:
        specs = [m.group(1) or "" for m in _PERCENT.finditer(text)]
    else:
        try:
            specs = [spec or "" for _, _, spec, _ in string.Formatter().parse(text)]
        except ValueError:
            return  # str.format raises the same error itself
    for spec in specs:
        if "*" in spec and percent:
            raise SecurityError("the chat template used a %-format width taken from its arguments")
        for digits in _WIDTH.findall(spec):
            if len(digits) > 6 or int(digits) > MAX_ARGUMENT:
                raise SecurityError(f"the chat template formats with a width of {digits}")


def _check_replace(text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        grows = (text.count(old) if old else len(text) + 1) * len(new)
        _budget().size(len(text) + grows, "a replaced string")


def _guarded_filter(name: str, func: Any) -> Any:
    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.step()
        values = list(args)
        first = next((i for i, a in enumerate(values) if not isinstance(a, (Context, EvalContext, Environment))),
                     len(values))
        _check_arguments(values[first + 1:] + list(kwargs.values()))
        if name == "join" and first < len(values) and not isinstance(values[first], str):
            values[first] = list(values[first])
            budget.size(sum(_length(item) + 1 for item in values[first]), "a joined string")
        elif name == "replace" and len(values) >= first + 3:
            _check_replace(*values[first:first + 3])
        elif name == "format" and first < len(values) and isinstance(values[first], str):
            _check_format(values[first], percent=True)
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
            _check_format(left, percent=True)
            _check_arguments(right if isinstance(right, tuple) else (right,))
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's form)
        budget = _budget()
        budget.step()
        _check_arguments(list(args) + list(kwargs.values()))
        bound = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(bound, str):
            method = getattr(getattr(__obj, "__wrapped__", __obj), "__name__", "")
            if method in ("format", "format_map"):
                _check_format(bound, percent=False)
            elif method == "replace" and len(args) >= 2:
                _check_replace(bound, args[0], args[1])
        out = super().call(__context, __obj, *args, **kwargs)
        budget.size(_length(out), "a call's result")
        return out

    def _parse(self, source: str, name: Optional[str], filename: Optional[str]) -> nodes.Template:
        """The parsed template with a tick at the start of every loop, macro and call-block body: it counts a step
        and the literal text that body writes each time it runs."""
        tree = super()._parse(source, name, filename)
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
    _budget().step(len(value) if isinstance(value, str) else 0)
    return value


def render_bounded(template: Any, input_chars: int, variables: Dict[str, Any]) -> str:
    """Render `template` (compiled by a BoundedSandbox) under a fresh budget for `input_chars` of messages."""
    previous = getattr(_active, "budget", None)
    _active.budget = Budget(input_chars)
    try:
        return template.render(**variables)
    finally:
        _active.budget = previous
