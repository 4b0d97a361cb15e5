"""A Lane is one KV cache being extended token by token: prefix reuse, context shift, prefill, decode steps.

The generator drives one lane per sequence it needs (the prompt; the negative prompt of CFG).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch

from kobold_backend.engine.cache import KVCache
from kobold_backend.engine.decode_graph import GraphDecoder
from kobold_backend.engine.model import Model

if TYPE_CHECKING:
    from kobold_backend.engine.passthrough.base import ForwardHooks

PREFILL_CHUNK = 2048
SHIFT_MIN_MATCH = 32


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def find_shift(
    cached: Sequence[int], new: Sequence[int], min_match: int = SHIFT_MIN_MATCH
) -> Optional[Tuple[int, int]]:
    """(start, drop) when `new` is `cached` with a span cut out after the common prefix (a trimmed front of a
    conversation, memory kept): dropping cached[start:start+drop] then lets the rest of the cache be reused.
    The kept run must be at least `min_match` tokens, or as long as what is left of either sequence."""
    start = common_prefix(cached, new)
    need = min(min_match, len(new) - start - 1)
    if need < 1 or start >= len(cached):
        return None
    probe = list(new[start : start + need])
    for drop in range(1, len(cached) - start - need + 1):
        if cached[start + drop] == probe[0] and list(cached[start + drop : start + drop + need]) == probe:
            return start, drop
    return None


class Lane:
    """A cache, the ids it holds (cache.tokens) and, on one CUDA device, a decode graph."""

    def __init__(self, model: Model, cache: KVCache, use_graphs: bool) -> None:
        self.model = model
        self.cache = cache
        self.graph = GraphDecoder(model, cache) if use_graphs else None
        self.dense = all(layer.mlp is None for layer in model.layers)
        self.tainted = False  # the cache holds states computed with a passthrough's actions

    def prepare(self, prompt: List[int], passthrough: Optional[ForwardHooks],
                context_shift: bool) -> Tuple[torch.Tensor, int]:
        """Bring the cache to `prompt` reusing what it can; returns (last logits [V], reused token count)."""
        cache = self.cache
        if passthrough is not None or self.tainted:
            cache.reset()  # states computed with other (or without these) actions must not be reused
        elif context_shift and not cache.recurrent:  # a recurrent state cannot drop a span: reuse the prefix
            shift = find_shift(cache.tokens, prompt)
            if shift is not None:
                self.model.shift_cache(cache, *shift)
        reuse = cache.restorable(min(common_prefix(cache.tokens, prompt), len(prompt) - 1))
        cache.truncate(reuse)
        self.tainted = passthrough is not None
        if cache.recurrent and reuse < len(prompt) - 1:
            # keep the states before the prompt's last token: the same prompt again (a retry) or one that extends
            # it (the next chat turn) restarts from there
            self.feed(prompt[reuse:-1], passthrough)
            cache.snapshot()
            return self.feed(prompt[-1:], passthrough), reuse
        return self.feed(prompt[reuse:], passthrough), reuse

    def feed(self, ids: Sequence[int], passthrough: Optional[ForwardHooks]) -> torch.Tensor:
        """Run ids through the model at the end of the cache; returns the last position's logits [V]. A short
        chunk (a chat turn's new tokens) replays a CUDA graph where the lane has them and the model's layers
        are dense (routed experts would be gathered per token inside a graph)."""
        if self.graph is not None and passthrough is None and self.dense:
            logits = self.graph.prefill(ids)
            if logits is not None:
                self.cache.tokens.extend(ids)
                return logits
        logits = None
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = list(ids[start : start + PREFILL_CHUNK])
            x = torch.tensor([chunk], dtype=torch.long, device=self.model.embed_tokens.device)
            try:
                logits = self.model.forward(x, self.cache, passthrough=passthrough)
            except BaseException:
                if self.cache.recurrent:
                    self.cache.drop_states()
                raise
            self.cache.tokens.extend(chunk)
        assert logits is not None
        return logits[0, -1]

    def step(self, token: int, passthrough: Optional[ForwardHooks]) -> torch.Tensor:
        """Feed one sampled token: a CUDA-graph replay when possible (passthrough runs eager)."""
        if self.graph is None or passthrough is not None:
            return self.feed([token], passthrough)
        logits = self.graph.step(token)
        self.cache.tokens.append(token)
        return logits

    def rows(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feed tokens in one forward and keep every position's logits [T, V] (a speculative verification): one
        CUDA-graph replay when possible, reading the weights once for all rows."""
        if self.graph is None:
            logits = self.model.forward(
                torch.tensor([list(tokens)], dtype=torch.long, device=self.model.embed_tokens.device), self.cache,
                last_only=False)[0]
        else:
            logits = self.graph.rows(tokens)
        self.cache.tokens.extend(tokens)
        return logits

    def rewind_to(self, length: int, passthrough: Optional[ForwardHooks]) -> torch.Tensor:
        """Keep `length` positions, then re-run the last kept token to get the logits that follow it (from the
        longest restorable length when the cache holds recurrent states)."""
        tokens = self.cache.tokens[:length]
        keep = self.cache.restorable(length - 1)
        self.cache.truncate(keep)
        return self.feed(tokens[keep:], passthrough)
