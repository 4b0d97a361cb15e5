"""Validation helpers for action parameters and the one way request names become paths: inside a configured
folder, with no absolute paths, no '..', and no symlink leading out of it."""

from __future__ import annotations

import math
import re
from pathlib import Path, PurePosixPath
from typing import Any, Collection, Dict, List, Optional, Sequence

from kobold_backend.engine.passthrough.base import ActionContext

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def as_object(value: Any, ctx: ActionContext, sub: str, allowed: Collection[str]) -> Dict[str, Any]:
    """A JSON object whose keys are all in `allowed`."""
    if not isinstance(value, dict):
        raise ctx.error(f"must be an object, not {type_name(value)}", sub)
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise ctx.error(f"unknown key {unknown[0]!r}; allowed keys: {', '.join(sorted(allowed))}", sub)
    return value


def as_entries(value: Any, ctx: ActionContext, limit: int) -> List[Any]:
    """An action's parameters given as one object or a list of objects -> the list (1..limit items)."""
    entries = value if isinstance(value, list) else [value]
    if not entries:
        raise ctx.error("must not be an empty list")
    if len(entries) > limit:
        raise ctx.error(f"has {len(entries)} entries; this server allows at most {limit}")
    return entries


def as_number(value: Any, ctx: ActionContext, sub: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ctx.error(f"must be a number, not {type_name(value)}", sub)
    number = float(value)
    if not math.isfinite(number):
        raise ctx.error("must be a finite number", sub)
    return number


def as_bool(value: Any, ctx: ActionContext, sub: str) -> bool:
    if not isinstance(value, bool):
        raise ctx.error(f"must be true or false, not {type_name(value)}", sub)
    return value


def as_string(value: Any, ctx: ActionContext, sub: str) -> str:
    if not isinstance(value, str) or not value:
        raise ctx.error(f"must be a non-empty string, not {type_name(value)}", sub)
    return value


def as_layer(value: Any, ctx: ActionContext, sub: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ctx.error(f"must be a layer index (an integer), not {type_name(value)}", sub)
    if not 0 <= value < ctx.num_layers:
        raise ctx.error(f"layer {value} is out of range; this model has layers 0..{ctx.num_layers - 1}", sub)
    return value


def as_layers(value: Any, ctx: ActionContext, sub: str) -> List[int]:
    """One layer index or a non-empty list of them, each in 0..num_layers-1; sorted, duplicates dropped."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ctx.error("must list at least one layer", sub)
    if len(items) > ctx.num_layers:
        raise ctx.error(f"lists {len(items)} layers but this model has {ctx.num_layers}", sub)
    return sorted({as_layer(v, ctx, f"{sub}[{i}]" if isinstance(value, list) else sub) for i, v in enumerate(items)})


def as_choice(value: Any, ctx: ActionContext, sub: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ctx.error(f"must be one of {', '.join(repr(c) for c in choices)}, not {value!r}", sub)
    return value


def check_file_name(name: str, ctx: ActionContext, sub: str) -> str:
    """A plain file name (letters, digits, '_', '-', '.'; no folders), as used for capture output files."""
    if not _NAME.match(name) or ".." in name or len(name) > 128:
        raise ctx.error(
            f"{name!r} is not a plain file name (letters, digits, '_', '-' and '.', at most 128 characters)", sub
        )
    return name


def resolve_in(folder: Optional[Path], name: Any, ctx: ActionContext, sub: str, what: str,
               suffixes: Sequence[str] = ("",)) -> Path:
    """`folder/name` (trying each suffix) after rejecting names that could leave the folder.

    Raises a RequestError when no folder is configured, the name is absolute, contains '..', a backslash or
    a drive, resolves (through symlinks) outside the folder, or names nothing.
    """
    name = as_string(name, ctx, sub)
    if folder is None:
        raise ctx.error(f"this server has no {what} folder configured", sub)
    pure = PurePosixPath(name)
    if "\\" in name or ":" in name or "\x00" in name or pure.is_absolute() or ".." in pure.parts:
        raise ctx.error(f"{name!r} must be a name inside the {what} folder (no absolute paths or '..')", sub)
    root = folder.resolve()
    for suffix in suffixes:
        candidate = folder / (name + suffix)
        if not candidate.exists():
            continue
        real = candidate.resolve()
        if real != root and root not in real.parents:
            raise ctx.error(f"{name!r} leads outside the {what} folder", sub)
        return real
    raise ctx.error(f"no {what} named {name!r} on this server", sub)
