"""The one check of request text: every string of a JSON body (keys too) must be encodable as UTF-8.

JSON allows escapes such as "\\ud800" (a lone UTF-16 surrogate) that decode to Python strings no tokenizer, stop
string or log line can encode. read_json runs this on every body of every dialect before anything tokenizes it,
so such a field is refused with one message naming it (422 on /api, 400 on /v1) instead of failing deep inside.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from kobold_backend.errors import RequestError

_SURROGATE = re.compile("[\ud800-\udfff]")


def bad_text_position(text: str) -> Optional[int]:
    """Index of the first lone surrogate in `text`, or None when the text is valid Unicode."""
    m = _SURROGATE.search(text)
    return None if m is None else m.start()


def check_text(text: str, field: str) -> None:
    """Raise RequestError naming `field` when `text` holds a lone surrogate."""
    at = bad_text_position(text)
    if at is not None:
        raise RequestError(f"{field} is not valid Unicode text: it holds a lone surrogate "
                           f"(\\u{ord(text[at]):04x}) at character {at}.", field)


def check_json_text(value: Any) -> None:
    """check_text on every string in a parsed JSON value; the field is named by its path (`messages[0].content`)."""
    stack = [(value, "body")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            check_text(item, path)
        elif isinstance(item, dict):
            for key, child in item.items():
                key_path = key if path == "body" else f"{path}.{key}"
                if isinstance(key, str) and bad_text_position(key) is not None:
                    check_text(key, f"{path} key")
                stack.append((child, key_path))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
