"""The working set of candidate logits every sampler family reads and narrows, plus the final draw."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

NEG_INF = float("-inf")


class Candidates:
    """Logits of the candidate tokens in a working order; removed tokens hold -inf.

    `ids[i]` is the token id at working position i (None while the order is the vocabulary order).
    `sorted` is True when `vals` is in descending order with every -inf at the end, so that a sampler
    may treat positions as ranks. On the CPU (`host` True) reading values on the host costs nothing,
    so removed tokens are dropped from the arrays (`compact`) and later sorts stay small; `dropped`
    counts them (they still count as -inf candidates). On an accelerator shapes stay fixed (no syncs).
    """

    __slots__ = ("vals", "ids", "sorted", "host", "dropped")

    def __init__(self, vals: torch.Tensor, host: bool) -> None:
        self.vals = vals
        self.ids: Optional[torch.Tensor] = None
        self.sorted = False
        self.host = host and vals.device.type == "cpu"
        self.dropped = 0

    def sort(self) -> None:
        """Reorder by descending logit (stable, so equal logits keep their working order)."""
        if self.sorted:
            return
        vals, perm = torch.sort(self.vals, descending=True, stable=True)
        self.vals = vals
        self.ids = perm if self.ids is None else self.ids[perm]
        self.sorted = True

    def per_token(self, values: torch.Tensor) -> torch.Tensor:
        """Gather a tensor indexed by token id into the working order."""
        return values if self.ids is None else values[self.ids]

    def token_at(self, pos: torch.Tensor) -> torch.Tensor:
        """The token id at a working position (a 1-element tensor)."""
        return pos if self.ids is None else self.ids[pos]

    def remove(self, mask: torch.Tensor, suffix: bool) -> None:
        """Set masked positions to -inf; `suffix` says the mask only removes a tail of the descending order."""
        self.vals = self.vals.masked_fill(mask, NEG_INF)
        if not suffix:
            self.sorted = False

    def select(self, positions: torch.Tensor, now_sorted: bool) -> None:
        """Keep only the given working positions (host only), in the given order."""
        self.dropped += self.vals.numel() - positions.numel()
        self.vals = self.vals[positions]
        self.ids = positions if self.ids is None else self.ids[positions]
        self.sorted = now_sorted

    def compact(self) -> None:
        """Drop removed tokens from the arrays (host only; at least one position is kept)."""
        if not self.host:
            return
        finite = (self.vals > NEG_INF).numpy()
        if self.sorted:
            n = max(1, int(finite.sum()))
            if n < finite.size:
                self.dropped += finite.size - n
                self.vals = self.vals[:n]
                if self.ids is not None:
                    self.ids = self.ids[:n]
                else:
                    self.ids = torch.arange(n)
            return
        keep = np.flatnonzero(finite)
        if keep.size == finite.size:
            return
        if keep.size == 0:
            keep = np.array([int(torch.argmax(self.vals))])
        self.select(torch.from_numpy(keep), now_sorted=False)

    def probs(self) -> torch.Tensor:
        """Softmax over the candidates (removed tokens get 0)."""
        return torch.softmax(self.vals, dim=-1)

    def probs64(self) -> torch.Tensor:
        """Softmax in float64, for cumulative sums compared against thresholds."""
        return torch.softmax(self.vals.double(), dim=-1)

    def to_vocab(self, vocab_size: int) -> torch.Tensor:
        """The logits back in vocabulary order."""
        if self.ids is None:
            return self.vals
        out = torch.full((vocab_size,), NEG_INF, dtype=self.vals.dtype, device=self.vals.device)
        out[self.ids] = self.vals
        return out


def draw(c: Candidates, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw from softmax(c.vals) with one uniform number; returns (position [1], probs).

    Never picks a zero-probability position while any probability is positive, and stays on the device.
    """
    probs = c.probs()
    cdf = probs.cumsum(0)
    total = cdf[-1:]
    u = torch.rand(1, generator=generator, device=c.vals.device, dtype=cdf.dtype)
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    pos = torch.searchsorted(cdf, x, right=True).clamp_(max=cdf.numel() - 1)
    return pos, probs
