"""The KV cache: per-layer K/V buffers allocated once, filled in place, never grown by concatenation."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from kobold_backend.errors import OutOfContextError


class KVCache:
    """K and V of every layer as [batch, kv_heads, max_seq_len, head_dim], plus the ids they hold.

    `seq_len` is how many positions are valid; `tokens` are the ids at those positions (batch row 0),
    kept by the generator so a new prompt can reuse the common prefix.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtypes: Sequence[torch.dtype],
        devices: Sequence[torch.device | str],
    ) -> None:
        if max_seq_len < 1:
            raise ValueError("max_seq_len must be at least 1")
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.k: List[torch.Tensor] = [torch.zeros(shape, dtype=dtypes[i], device=devices[i]) for i in range(num_layers)]
        self.v: List[torch.Tensor] = [torch.zeros(shape, dtype=dtypes[i], device=devices[i]) for i in range(num_layers)]
        self.seq_len = 0
        self.tokens: List[int] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reserve(self, n: int) -> int:
        """Check that n more positions fit; returns the position they start at."""
        if self.seq_len + n > self.max_seq_len:
            raise OutOfContextError(
                f"{self.seq_len + n} tokens do not fit in a cache of {self.max_seq_len} positions."
            )
        return self.seq_len

    def truncate(self, n: int) -> None:
        """Keep only the first n positions (the buffers are untouched; later writes overwrite)."""
        if not 0 <= n <= self.seq_len:
            raise ValueError(f"cannot truncate a cache of {self.seq_len} positions to {n}")
        self.seq_len = n
        del self.tokens[n:]

    def rewind(self, n: int) -> None:
        self.truncate(self.seq_len - n)

    def reset(self) -> None:
        self.truncate(0)

    def copy_from(self, other: KVCache, length: Optional[int] = None) -> None:
        """Copy the first `length` positions (default: all valid ones) of another cache of the same shape."""
        n = other.seq_len if length is None else length
        if n > self.max_seq_len:
            raise OutOfContextError(f"{n} positions do not fit in a cache of {self.max_seq_len}.")
        for dst, src in zip(self.k + self.v, other.k + other.v):
            dst[:, :, :n].copy_(src[:, :, :n])
        self.seq_len = n
        self.tokens = list(other.tokens[:n])

    def clone(self) -> KVCache:
        twin = KVCache.__new__(KVCache)
        twin.max_seq_len = self.max_seq_len
        twin.batch_size = self.batch_size
        twin.k = [t.clone() for t in self.k]
        twin.v = [t.clone() for t in self.v]
        twin.seq_len = self.seq_len
        twin.tokens = list(self.tokens)
        return twin
