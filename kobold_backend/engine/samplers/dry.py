"""DRY ("don't repeat yourself"): penalise tokens that would extend a repeat of the context's suffix.

Per spec: a token that would extend a repeated suffix of length n >= allowed_length loses
multiplier * base^(n - allowed_length); repeats do not extend across a sequence breaker; only the last
`penalty_last_n` tokens count (<= 0: the whole context). As in KoboldCpp, n for a candidate is the longest
match between the context's suffix and an earlier stretch of the window that the candidate follows.

State: for each position i of the window, match[i] = the length of the common suffix of context[..i]
and the whole context. Appending token t turns it into match'[i] = match[i-1] + 1 if context[i] == t
else 0, one vectorised step over the window on the device; a Z-algorithm pass rebuilds it on begin and
rewind. Sequence breakers are matched on token text: a token whose text (joined with the preceding
tokens' text) completes a breaker string ends every repeat.
"""

from __future__ import annotations

import json
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from kobold_backend.errors import RequestError

# KoboldCpp's cap on the number of sequence breakers.
MAX_SEQUENCE_BREAKERS = 24
# ln(FLT_MAX): base^exponent is clamped below this, as in KoboldCpp.
FLOAT_MAX_LOG = 88.7228391


def parse_sequence_breakers(value: Union[str, Sequence[str], None]) -> Tuple[str, ...]:
    """Read `dry_sequence_breakers` given as a list of strings or as a JSON string holding one.

    A JSON string that decodes to a plain string is one breaker. At most 24 are kept (KoboldCpp's limit).
    """
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise RequestError("dry_sequence_breakers is not valid JSON", "dry_sequence_breakers") from exc
        except RecursionError:
            raise RequestError("dry_sequence_breakers nests too deeply to be a list of strings",
                               "dry_sequence_breakers") from None
        if isinstance(value, str):
            value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise RequestError("dry_sequence_breakers must be a list of strings", "dry_sequence_breakers")
    return tuple(value[:MAX_SEQUENCE_BREAKERS])


def suffix_matches(tokens: Sequence[int]) -> List[int]:
    """For each i < len-1: the length of the longest common suffix of tokens[..i] and tokens (Z-algorithm)."""
    rev = list(reversed(tokens))
    n = len(rev)
    z = [0] * n
    left = right = 0
    for k in range(1, n):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < n and rev[z[k]] == rev[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return [z[n - 1 - i] for i in range(n - 1)]


class DryPenalty:
    """DRY state for one request: the window's suffix matches on the device, breaker positions on the host."""

    def __init__(
        self,
        multiplier: float,
        base: float,
        allowed_length: int,
        penalty_last_n: int,
        sequence_breakers: Sequence[str],
        vocab_size: int,
        device: torch.device,
        token_texts: Optional[Sequence[str]],
    ) -> None:
        self.multiplier = multiplier
        self.base = base
        self.allowed = allowed_length
        self.last_n = penalty_last_n
        self.vocab_size = vocab_size
        self.device = device
        self.active = multiplier > 0.0 and base > 0.0
        self.max_exponent = int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
        self._breakers = tuple(b for b in sequence_breakers if b) if token_texts is not None else ()
        self._max_breaker = max((len(b) for b in self._breakers), default=0)
        self._texts = token_texts
        self._breaker_cache: Dict[int, bool] = {}
        self._length = 0
        self._last_breaker = -1
        self._capacity = 0
        self._hist = torch.empty(0, dtype=torch.long, device=device)
        self._match = torch.empty(0, dtype=torch.long, device=device)
        self._ramp = torch.empty(0, dtype=torch.long, device=device)
        self._longest = torch.zeros(vocab_size + 1 if self.active else 0, dtype=torch.long, device=device)
        # The context again with ids outside the vocabulary as vocab_size (scatter targets).
        self._slots = torch.empty(0, dtype=torch.long, device=device)
        self._zero = torch.zeros(1, dtype=torch.float32, device=device)

    def window(self, length: int) -> int:
        """How many of the newest tokens DRY looks at."""
        return length if self.last_n <= 0 else min(length, self.last_n)

    def _reserve(self, length: int, keep: int) -> None:
        """Make room for `length` positions, keeping the first `keep` of the current buffers."""
        if length <= self._capacity:
            return
        capacity = max(1024, 2 * length)
        hist = torch.zeros(capacity, dtype=torch.long, device=self.device)
        match = torch.zeros(capacity, dtype=torch.long, device=self.device)
        slots = torch.zeros(capacity, dtype=torch.long, device=self.device)
        hist[:keep] = self._hist[:keep]
        match[:keep] = self._match[:keep]
        slots[:keep] = self._slots[:keep]
        self._hist, self._match, self._slots, self._capacity = hist, match, slots, capacity
        self._ramp = torch.arange(1, capacity + 1, dtype=torch.long, device=self.device)

    def _slot(self, token: int) -> int:
        return token if 0 <= token < self.vocab_size else self.vocab_size

    def _text(self, token: int) -> str:
        texts = self._texts
        return texts[token] if texts is not None and 0 <= token < len(texts) else ""

    def _contains_breaker(self, token: int) -> bool:
        hit = self._breaker_cache.get(token)
        if hit is None:
            text = self._text(token)
            hit = any(b in text for b in self._breakers)
            self._breaker_cache[token] = hit
        return hit

    def _ends_breaker(self, context: Sequence[int], i: int) -> bool:
        """Whether a breaker string ends inside the text of context[i] (it may start in earlier tokens)."""
        if self._contains_breaker(context[i]):
            return True
        if self._max_breaker < 2:
            return False
        head = ""
        j = i - 1
        while j >= 0 and len(head) < self._max_breaker - 1 and i - j <= 4 * self._max_breaker:
            head = self._text(context[j]) + head
            j -= 1
        tail = head + self._text(context[i])
        return any(tail.find(b, max(0, len(head) - len(b) + 1)) != -1 for b in self._breakers)

    def reset(self, context: List[int]) -> None:
        """Rebuild the state for a whole context (begin, rewind)."""
        self._length = len(context)
        self._last_breaker = -1
        if not self.active:
            return
        self._reserve(self._length, 0)
        if self._length:
            self._hist[: self._length] = torch.tensor(context, dtype=torch.long, device=self.device)
            self._slots[: self._length] = torch.tensor(
                [self._slot(t) for t in context], dtype=torch.long, device=self.device
            )
        start = max(0, self._length - self.window(self._length) - 1)
        if self._length - start >= 2:
            matches = suffix_matches(context[start:])
            self._match[start : self._length - 1] = torch.tensor(matches, dtype=torch.long, device=self.device)
        if self._breakers:
            for i in range(self._length - 1, start - 1, -1):
                if self._ends_breaker(context, i):
                    self._last_breaker = i
                    break

    def push(self, context: List[int]) -> None:
        """Account for context[-1], just appended."""
        length = len(context)
        self._length = length
        if not self.active:
            return
        self._reserve(length, length - 1)
        token = context[-1]
        self._hist[length - 1 : length].fill_(token)
        self._slots[length - 1 : length].fill_(self._slot(token))
        lo = max(0, length - self.window(length) - 1)
        hi = length - 1
        if hi > lo:
            seg = self._hist[lo:hi]
            if lo > 0:
                prev = self._match[lo - 1 : hi - 1]
            else:
                prev = torch.cat((self._match.new_zeros(1), self._match[: hi - 1]))
            self._match[lo:hi] = torch.where(seg == token, prev + 1, torch.zeros_like(prev))
        if self._breakers and self._ends_breaker(context, length - 1):
            self._last_breaker = length - 1

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Subtract the DRY penalties from logits in vocabulary order."""
        length = self._length
        w = self.window(length)
        if not self.active or w <= self.allowed or w < 2:
            return logits
        start = length - w
        rep_limit = w if self._last_breaker < start else length - 1 - self._last_breaker
        if rep_limit <= self.allowed:
            return logits
        matches = torch.minimum(self._match[start : length - 1], self._ramp[: w - 1]).clamp_(max=rep_limit)
        value = (matches + 1).masked_fill_(matches < self.allowed, 0)
        followers = self._slots[start + 1 : length]
        # Per-token maximum over the window through a persistent buffer, touching only these slots.
        longest = self._longest
        longest.index_fill_(0, followers, 0)
        longest.scatter_reduce_(0, followers, value, "amax")
        best = longest[followers]
        exponent = best - (1 + self.allowed)
        if self.max_exponent > 0:
            exponent = exponent.clamp_(max=self.max_exponent)
        penalty = (self.multiplier * torch.pow(self.base, exponent.to(logits.dtype))).masked_fill_(best == 0, 0.0)
        padded = torch.cat((logits, self._zero))
        padded[followers] = padded[followers] - penalty
        return padded[: self.vocab_size]
