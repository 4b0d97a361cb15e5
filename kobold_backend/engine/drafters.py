"""Drafters for speculative decoding: they guess the next few tokens cheaply, the target model then checks them.

- NgramDrafter (prompt lookup): finds the latest earlier occurrence of the context's last n tokens and proposes
  what followed it; no second model. Its proposals are certain (a point mass q).
- ModelDrafter: a small model with the same tokenizer, its own KV cache in a Lane (prefix reuse and context shift
  as the target's), sampling through the request's own sampler transforms so its q is close to the target's p.

check_draft_tokenizer() refuses a draft whose vocabulary or special ids differ from the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch

from kobold_backend.engine.lane import Lane, common_prefix
from kobold_backend.engine.model import Model
from kobold_backend.engine.samplers.candidates import NEG_INF
from kobold_backend.engine.sampling import Sampler
from kobold_backend.engine.tokenizer import Tokenizer
from kobold_backend.errors import ModelFormatError

DEFAULT_NGRAM_MAX = 3
DEFAULT_NGRAM_MIN = 1


@dataclass
class Draft:
    """Proposed tokens and, per token, the distribution q [V] it was drawn from (None: a point mass on it)."""

    tokens: List[int]
    q: List[Optional[torch.Tensor]]


def check_draft_tokenizer(target: Tokenizer, draft: Tokenizer, draft_name: str = "the draft model") -> None:
    """Raise ModelFormatError in one sentence unless both tokenizers have the same vocabulary and special ids."""
    t_strings, d_strings = target.token_strings(), draft.token_strings()
    if len(t_strings) != len(d_strings):
        raise ModelFormatError(f"{draft_name} has a vocabulary of {len(d_strings)} tokens but the model has "
                               f"{len(t_strings)}: a draft model must use the same tokenizer.")
    for i, (a, b) in enumerate(zip(t_strings, d_strings)):
        if a != b:
            raise ModelFormatError(f"{draft_name} reads token {i} as {b!r} but the model reads it as {a!r}: "
                                   "a draft model must use the same tokenizer.")
    if target.bos_id != draft.bos_id or sorted(target.eos_ids) != sorted(draft.eos_ids):
        raise ModelFormatError(f"{draft_name} has BOS {draft.bos_id} and EOS {sorted(draft.eos_ids)} but the model "
                               f"has BOS {target.bos_id} and EOS {sorted(target.eos_ids)}: a draft model must use "
                               "the same tokenizer.")


class NgramDrafter:
    """Prompt lookup: match the last `max_n`..`min_n` tokens earlier in the context, propose what came next."""

    def __init__(self, max_n: int = DEFAULT_NGRAM_MAX, min_n: int = DEFAULT_NGRAM_MIN) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("n-gram sizes must satisfy 1 <= min_n <= max_n")
        self.max_n = max_n
        self.min_n = min_n

    def begin(self, sampler: Sampler, context_shift: bool) -> None:
        """Nothing to prepare: the context is all it reads."""

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching context suffix."""
        if k < 1 or len(context) < 2:
            return Draft([], [])
        arr = np.asarray(context, dtype=np.int64)
        size = len(arr)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            starts = size - n  # candidate starts 0..size-n-1: the suffix itself (at size-n) is excluded
            match = np.ones(starts, dtype=bool)
            for j in range(n):
                match &= arr[j : j + starts] == arr[size - n + j]
            hits = np.flatnonzero(match)
            if hits.size:
                at = int(hits[-1]) + n
                tokens = [int(t) for t in arr[at : at + k]]
                return Draft(tokens, [None] * len(tokens))
        return Draft([], [])


class ModelDrafter:
    """A draft model on its own cache; draws with a twin of the request's sampler (same settings and context)."""

    def __init__(self, model: Model, vocab_size: int, max_seq_len: int, use_graphs: bool) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.lane = Lane(model, model.new_cache(min(max_seq_len, model.max_seq_len)), use_graphs)
        self.sampler: Optional[Sampler] = None
        self.context_shift = True
        self._fresh = True

    def begin(self, sampler: Sampler, context_shift: bool) -> None:
        """Start a request: a twin of its sampler with its own random stream, and a cache to resynchronise."""
        self.sampler = sampler.twin(self.model.device, (sampler.seed + 1) % 2**64)
        self.sampler.begin(list(sampler.context))
        self.context_shift = context_shift
        self._fresh = True

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary (padding ids past either one are never drawn)."""
        x = logits.reshape(-1).float()
        n = x.numel()
        if n == self.vocab_size:
            return x
        if n > self.vocab_size:
            return x[: self.vocab_size]
        return torch.cat([x, x.new_full((self.vocab_size - n,), NEG_INF)])

    def _sync(self, context: Sequence[int]) -> torch.Tensor:
        """Bring the draft cache to `context`; returns the logits after its last token."""
        ctx = list(context)
        if self._fresh:
            self._fresh = False
            return self.lane.prepare(ctx, None, self.context_shift)[0]
        cache = self.lane.cache
        keep = min(common_prefix(cache.tokens, ctx), len(ctx) - 1)
        cache.truncate(keep)
        rest = ctx[keep:]
        return self.lane.step(rest[0], None) if len(rest) == 1 else self.lane.feed(rest, None)

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """k tokens drawn one by one from the draft model through the request's sampler transforms."""
        sampler = self.sampler
        if k < 1 or sampler is None:
            return Draft([], [])
        room = self.lane.cache.max_seq_len - len(context)
        k = min(k, room)
        if k < 1:
            return Draft([], [])
        keep = common_prefix(sampler.context, context)
        sampler.rewind(len(sampler.context) - keep)
        for token in context[keep:]:
            sampler.accept(token)
        logits = self._sync(context)
        greedy = sampler.settings.temperature <= 0.0
        tokens: List[int] = []
        qs: List[Optional[torch.Tensor]] = []
        for i in range(k):
            x = self._logits(logits)
            if greedy:
                token, q = sampler.sample(x), None
            else:
                q = torch.softmax(sampler.warp(x), dim=-1)
                token = int(torch.multinomial(q, 1, generator=sampler.generator).item())
            tokens.append(token)
            qs.append(q)
            sampler.accept(token)
            if i + 1 < k:
                logits = self.lane.step(token, None)
        return Draft(tokens, qs)
