"""Giving back the memory a refused or failed model load took: Python's cycles collected, then (glibc) the C
allocator's free pages returned to the system, which it otherwise keeps in per-thread arenas for good."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from typing import Any, Optional

_libc: Optional[Any] = None


def _trim() -> None:
    global _libc
    if not sys.platform.startswith("linux"):
        return
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            _libc = False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None  # glibc only (not musl)
    if trim is not None:
        trim(0)


def return_freed_memory() -> None:
    """Collect what is unreachable and hand the allocator's free pages back (a few ms; call after a failure)."""
    gc.collect()
    _trim()
