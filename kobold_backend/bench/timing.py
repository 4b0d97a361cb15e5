"""Timers that respect asynchronous devices (synchronise before reading the clock), and the random token ids
every engine is timed on (the same seeds give every engine the same prompts)."""

from __future__ import annotations

import time
from typing import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of fn takes, device work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if device.type != "cuda":
        nbytes = min(nbytes, 1 << 27)
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(lambda: dst.copy_(src), device) for _ in range(repeats))
    return 2 * nbytes / best


def random_ids(n: int, vocab: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, n] token ids in 3..vocab-1 (no special ids), the same for a given seed on every engine."""
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)
