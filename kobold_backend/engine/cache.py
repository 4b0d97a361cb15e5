"""The KV cache: per-layer K/V buffers allocated once, filled in place, never grown by concatenation.

K and V are kept in the layer's dtype ('fp16', the default) or quantized to 8 or 4 bits (ops/kv_quant.py: groups
of 32 values per position and head, Hadamard-rotated, one fp16 scale each); keys and values may differ.
Layers may differ in KV heads and head size (Gemma 4), and a layer may share an earlier layer's buffers (Gemma 4's
KV sharing: `sources[i]` names the layer whose K/V layer i reads; its entries are that layer's own objects).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from kobold_backend.errors import OutOfContextError
from kobold_backend.ops.kv_quant import BITS, QuantizedKV, bytes_per_vector

# --cache-dtype: (keys, values). 'k8v4' keeps the keys, which attention is more sensitive to, at 8 bits.
CACHE_DTYPES: Dict[str, Tuple[str, str]] = {
    "fp16": ("fp16", "fp16"),
    "q8": ("q8", "q8"),
    "q4": ("q4", "q4"),
    "k8v4": ("q8", "q4"),
}


def cache_schemes(cache_dtype: str) -> Tuple[str, str]:
    """The (key, value) schemes of a --cache-dtype name, or ValueError naming the choices."""
    try:
        return CACHE_DTYPES[cache_dtype]
    except KeyError:
        raise ValueError(f"cache dtype must be one of {', '.join(CACHE_DTYPES)}, not {cache_dtype!r}") from None


def check_cache_dtype(cache_dtype: str, head_dim: int) -> None:
    """Refuse a quantized cache for a head size the 32-value groups do not divide."""
    if cache_schemes(cache_dtype) != ("fp16", "fp16") and head_dim % 32:
        raise ValueError(f"--cache-dtype {cache_dtype} needs a head size that is a multiple of 32; this model's is "
                         f"{head_dim}: use --cache-dtype fp16")


def cache_bytes_per_token(cache_dtype: str, num_kv_heads: int, head_dim: int, elem: int) -> int:
    """Bytes of K and V one position takes in one layer (`elem`: bytes of the layer's dtype)."""
    k, v = cache_schemes(cache_dtype)
    return num_kv_heads * (bytes_per_vector(k, head_dim, elem) + bytes_per_vector(v, head_dim, elem))


def _buffer(shape: Tuple[int, int, int, int], scheme: str, dtype: torch.dtype, device: Any) -> Any:
    if scheme in BITS:
        return QuantizedKV.empty(shape, BITS[scheme], dtype, device)
    return torch.zeros(shape, dtype=dtype, device=device)


def buffer_bytes(t: Any) -> int:
    """Bytes of one K or V buffer (a tensor or a QuantizedKV) or a view of one."""
    return t.nbytes if isinstance(t, QuantizedKV) else t.numel() * t.element_size()


def _per_layer(value: Union[int, Sequence[int]], n: int) -> Sequence[int]:
    return (value,) * n if isinstance(value, int) else value[:n]


class KVCache:
    """K and V of every layer as [batch, kv_heads, max_seq_len, head_dim], plus the ids they hold.

    `value_dim` gives V another size per head than K (0: no values; DeepSeek's latent cache reads them from K).

    `cache_dtype` (a CACHE_DTYPES name) makes the buffers QuantizedKV, indexed and copied like those tensors.

    `seq_len` is how many positions are valid; `tokens` are the ids at those positions (batch row 0),
    kept by the generator so a new prompt can reuse the common prefix.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: Union[int, Sequence[int]],
        max_seq_len: int,
        head_dim: Union[int, Sequence[int]],
        dtypes: Sequence[torch.dtype],
        devices: Sequence[torch.device | str],
        cache_dtype: str = "fp16",
        value_dim: Optional[int] = None,
        sources: Sequence[Optional[int]] = (),
    ) -> None:
        if max_seq_len < 1:
            raise ValueError("max_seq_len must be at least 1")
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        self.cache_dtype = cache_dtype
        k_scheme, v_scheme = cache_schemes(cache_dtype)
        heads = _per_layer(num_kv_heads, num_layers)
        dims = _per_layer(head_dim, num_layers)
        self.sources: Tuple[Optional[int], ...] = tuple(sources[:num_layers]) or (None,) * num_layers
        self.k: List[Any] = []
        self.v: List[Any] = []
        for i, src in enumerate(self.sources):
            if src is not None:
                self.k.append(self.k[src])
                self.v.append(self.v[src])
                continue
            shape = (batch_size, heads[i], max_seq_len, dims[i])
            v_shape = shape if value_dim is None else (batch_size, heads[i], max_seq_len, value_dim)
            self.k.append(_buffer(shape, k_scheme, dtypes[i], devices[i]))
            self.v.append(_buffer(v_shape, v_scheme, dtypes[i], devices[i]))
        self.seq_len = 0
        self.tokens: List[int] = []

    @property
    def nbytes(self) -> int:
        return sum(buffer_bytes(t) for i, t in enumerate(self.k + self.v)
                   if self.sources[i % len(self.k)] is None)

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
        for i, (dst, src) in enumerate(zip(self.k + self.v, other.k + other.v)):
            if self.sources[i % len(self.k)] is None:
                dst[:, :, :n].copy_(src[:, :, :n])
        self.seq_len = n
        self.tokens = list(other.tokens[:n])

    def clone(self) -> KVCache:
        twin = KVCache.__new__(KVCache)
        twin.max_seq_len = self.max_seq_len
        twin.batch_size = self.batch_size
        twin.cache_dtype = self.cache_dtype
        twin.sources = self.sources
        twin.k, twin.v = [], []
        for i, src in enumerate(self.sources):
            twin.k.append(self.k[i].clone() if src is None else twin.k[src])
            twin.v.append(self.v[i].clone() if src is None else twin.v[src])
        twin.seq_len = self.seq_len
        twin.tokens = list(self.tokens)
        return twin
