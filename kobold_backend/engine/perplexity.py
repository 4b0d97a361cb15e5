"""Perplexity of a model on a token sequence, with the KV cache in a chosen dtype (the quality check of the
quantized caches: `kobold-backend bench --perplexity FILE --cache-dtype q4`).

The text is cut into windows of at most the cache length (no overlap); each window is fed in chunks through one
cache, so every chunk attends to the earlier positions as stored in that cache (quantized, for q8/q4), as decoding
does. Perplexity is exp of the mean negative log-likelihood of every token after the first of each window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kobold_backend.engine.model import Model


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    tokens: int  # tokens scored
    cache_dtype: str

    @property
    def mean_nll(self) -> float:
        return math.log(self.perplexity)


def perplexity(model: Model, ids: Sequence[int], cache_dtype: Optional[str] = None, window: Optional[int] = None,
               chunk: int = 128) -> Perplexity:
    """Perplexity of `ids` under `model`; `cache_dtype` defaults to the model's, `window` to its context."""
    if len(ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    if chunk < 1:
        raise ValueError("chunk must be at least 1")
    n = min(window or model.max_seq_len, model.max_seq_len)
    if n < 2:
        raise ValueError("the window must hold at least 2 tokens")
    cache = model.new_cache(n, cache_dtype=cache_dtype)
    device = model.embed_tokens.device
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, n):
        piece = list(ids[start : start + n])
        if len(piece) < 2:
            break
        cache.reset()
        for c in range(0, len(piece) - 1, chunk):
            x = torch.tensor([piece[c : c + chunk]], dtype=torch.long, device=device)
            logits = model.forward(x, cache, last_only=False)[0].float()
            targets = torch.tensor(piece[c + 1 : c + 1 + x.shape[1]], dtype=torch.long, device=logits.device)
            logp = torch.log_softmax(logits[: targets.shape[0]], dim=-1)
            total -= float(logp.gather(1, targets.unsqueeze(1)).sum())
            count += int(targets.shape[0])
    return Perplexity(math.exp(total / count), count, cache.cache_dtype)
