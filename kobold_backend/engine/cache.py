"""The KV cache: per-layer K/V buffers allocated once, filled in place, never grown by concatenation.

K and V are kept in the layer's dtype ('fp16', the default) or quantized to 8 or 4 bits (ops/kv_quant.py: groups
of 32 values per position and head, Hadamard-rotated, one fp16 scale each); keys and values may differ.
Layers may differ in KV heads and head size (Gemma 4), and a layer may share an earlier layer's buffers (Gemma 4's
KV sharing: `sources[i]` names the layer whose K/V layer i reads; its entries are that layer's own objects).

Layers with a recurrent token mixer (engine/linear_attention.py) keep a fixed-size state instead of K/V (their K/V
buffers hold no positions). Such a state holds the whole prefix and cannot be cut back to an earlier length, so the
cache keeps a few snapshots of every state (`snapshot()`, taken by the lane after a prompt's next-to-last token):
`restorable(n)` is the longest length <= n the cache can return to, and `truncate` goes only there.
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
#: recurrent-state snapshots a cache keeps (each as large as all the states: ~100 MB for a 27B Qwen3.5)
MAX_SNAPSHOTS = 2


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
        kv_layers: Optional[Sequence[bool]] = None,
        states: Optional[Sequence[Any]] = None,
    ) -> None:
        if max_seq_len < 1:
            raise ValueError("max_seq_len must be at least 1")
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        self.cache_dtype = cache_dtype
        k_scheme, v_scheme = cache_schemes(cache_dtype)
        heads = _per_layer(num_kv_heads, num_layers)
        dims = _per_layer(head_dim, num_layers)
        kv = list(kv_layers) if kv_layers is not None else [True] * num_layers
        self.sources: Tuple[Optional[int], ...] = tuple(sources[:num_layers]) or (None,) * num_layers
        self.k: List[Any] = []
        self.v: List[Any] = []
        for i, src in enumerate(self.sources):
            if src is not None:
                self.k.append(self.k[src])
                self.v.append(self.v[src])
                continue
            shape = (batch_size, heads[i], max_seq_len if kv[i] else 0, dims[i])
            v_shape = shape if value_dim is None else shape[:3] + (value_dim,)
            self.k.append(_buffer(shape, k_scheme, dtypes[i], devices[i]))
            self.v.append(_buffer(v_shape, v_scheme, dtypes[i], devices[i]))
        #: per layer, the recurrent state of a linear-attention layer (None: the layer keeps K/V)
        self.states: List[Any] = list(states) if states is not None else [None] * num_layers
        #: (length, the states at that length) for lengths the cache can be truncated back to
        self.snapshots: List[Tuple[int, List[Any]]] = []
        self.seq_len = 0
        self.tokens: List[int] = []

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state (then lengths can only be restored to snapshots)."""
        return any(s is not None for s in self.states)

    @property
    def nbytes(self) -> int:
        held = [s for s in self.states if s is not None] + [s for _, snap in self.snapshots for s in snap]
        return sum(buffer_bytes(t) for i, t in enumerate(self.k + self.v)
                   if self.sources[i % len(self.k)] is None) + sum(s.nbytes for s in held)

    def restorable(self, n: int) -> int:
        """The longest length <= n this cache can be truncated to: n itself unless a recurrent state would have to
        forget positions, then the longest snapshot <= n (0: the empty state)."""
        if not self.recurrent or n >= self.seq_len:
            return n
        return max([p for p, _ in self.snapshots if p <= n] + [0])

    def snapshot(self) -> None:
        """Keep a copy of every recurrent state at the current length (the last MAX_SNAPSHOTS are kept)."""
        if not self.recurrent or any(p == self.seq_len for p, _ in self.snapshots) or self.seq_len == 0:
            return
        self.snapshots.append((self.seq_len, [s.clone() for s in self.states if s is not None]))
        del self.snapshots[:-MAX_SNAPSHOTS]

    def reserve(self, n: int) -> int:
        """Check that n more positions fit; returns the position they start at."""
        if self.seq_len + n > self.max_seq_len:
            raise OutOfContextError(
                f"{self.seq_len + n} tokens do not fit in a cache of {self.max_seq_len} positions."
            )
        return self.seq_len

    def truncate(self, n: int) -> None:
        """Keep only the first n positions (the buffers are untouched; later writes overwrite). With recurrent
        states n must be `restorable`: the current length, a snapshot's or 0."""
        if not 0 <= n <= self.seq_len:
            raise ValueError(f"cannot truncate a cache of {self.seq_len} positions to {n}")
        if self.recurrent and (n != self.seq_len or n == 0):
            self._restore(n)
        self.seq_len = n
        del self.tokens[n:]

    def _restore(self, n: int) -> None:
        live = [s for s in self.states if s is not None]
        if n == 0:
            for state in live:
                state.zero_()
        else:
            saved = [snap for p, snap in self.snapshots if p == n]
            if not saved:
                raise ValueError(f"this cache's recurrent states cannot return to length {n} (restorable: "
                                 f"{self.restorable(n)})")
            for state, copy in zip(live, saved[0]):
                state.copy_(copy)
        self.snapshots = [(p, snap) for p, snap in self.snapshots if p <= n]

    def drop_states(self) -> None:
        """Forget everything after a forward that stopped part-way: its recurrent states hold positions the cache
        does not list (K/V written past seq_len are harmless, a state that ran ahead is not)."""
        self.seq_len = 0
        self.tokens.clear()
        self.snapshots.clear()
        self._restore(0)

    def rewind(self, n: int) -> None:
        self.truncate(self.seq_len - n)

    def reset(self) -> None:
        self.truncate(0)

    def copy_from(self, other: KVCache, length: Optional[int] = None) -> None:
        """Copy the first `length` positions (default: all valid ones) of another cache of the same shape."""
        n = other.seq_len if length is None else length
        if n > self.max_seq_len:
            raise OutOfContextError(f"{n} positions do not fit in a cache of {self.max_seq_len}.")
        if other.recurrent and n != other.seq_len:
            raise ValueError("a cache with recurrent states can only be copied whole")
        for i, (dst, src) in enumerate(zip(self.k + self.v, other.k + other.v)):
            if self.sources[i % len(self.k)] is None:
                dst[:, :, :n].copy_(src[:, :, :n])
        for mine, theirs in zip(self.states, other.states):
            if mine is not None:
                mine.copy_(theirs)
        self.snapshots = [(p, [s.clone() for s in snap]) for p, snap in other.snapshots]
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
        twin.states = [None if s is None else s.clone() for s in self.states]
        twin.snapshots = [(p, [s.clone() for s in snap]) for p, snap in self.snapshots]
        twin.seq_len = self.seq_len
        twin.tokens = list(self.tokens)
        return twin
