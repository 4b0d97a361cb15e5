"""Streaming beam search with little memory, as exllama did it.

The main cache holds the committed tokens. Each beam keeps only the K/V columns of the tokens since
the beams split (at most `beam_length` of them) and is swapped into the main cache when it is extended.
Once the beams are `beam_length` tokens long, the first token of the best beam is committed; beams that
do not start with it are dropped and the survivors shift left by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Sequence, Tuple

import torch

from kobold_backend.engine.cache import buffer_bytes
from kobold_backend.engine.lane import Lane


@dataclass
class Beam:
    tokens: List[int]
    logprobs: List[float]  # of each token, given everything before it
    logits: torch.Tensor  # after the last token
    k: List[torch.Tensor]  # per layer [B, Hkv, len(tokens), D]
    v: List[torch.Tensor]

    @property
    def score(self) -> float:
        return sum(self.logprobs)


class BeamSearch:
    """Committed tokens one at a time from `num_beams` beams looking `beam_length` tokens ahead."""

    def __init__(self, lane: Lane, logits: torch.Tensor, num_beams: int, beam_length: int,
                 banned: Sequence[int] = ()) -> None:
        if num_beams < 1 or beam_length < 1:
            raise ValueError("num_beams and beam_length must be at least 1")
        self.lane = lane
        self.num_beams = num_beams
        self.beam_length = beam_length
        self.banned = list(banned)
        self.base = lane.cache.seq_len
        self.beams = [Beam([], [], logits.float().clone(), [], [])]
        self.logprob = 0.0  # of the committed tokens
        self.peak_beam_bytes = 0

    def tokens(self, max_tokens: int) -> Iterator[int]:
        """Yield up to max_tokens committed ids; the caller stops iterating at EOS or a stop string."""
        for produced in range(max_tokens):
            lookahead = min(self.beam_length, max_tokens - produced)
            while len(self.beams[0].tokens) < lookahead:
                self._expand()
            yield self._commit()

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        scores = logits.float().clone()
        if self.banned:
            scores[self.banned] = float("-inf")
        return torch.log_softmax(scores, dim=-1)

    def _load(self, beam: Beam) -> None:
        """Put the beam's columns right after the committed tokens in the main cache."""
        cache = self.lane.cache
        n = len(beam.tokens)
        if n:
            for layer in range(len(cache.k)):
                cache.k[layer][:, :, self.base : self.base + n].copy_(beam.k[layer])
                cache.v[layer][:, :, self.base : self.base + n].copy_(beam.v[layer])
        cache.seq_len = self.base + n
        del cache.tokens[self.base :]
        cache.tokens.extend(beam.tokens)

    def _extend(self, parent: Beam, token: int, logprob: float) -> Beam:
        self._load(parent)
        logits = self.lane.step(token, None).float().clone()
        cache = self.lane.cache
        end = cache.seq_len
        return Beam(parent.tokens + [token], parent.logprobs + [logprob], logits,
                    [t[:, :, self.base : end].clone() for t in cache.k],
                    [t[:, :, self.base : end].clone() for t in cache.v])

    def _expand(self) -> None:
        candidates: List[Tuple[float, int, int, float]] = []
        for index, beam in enumerate(self.beams):
            top = torch.topk(self._log_probs(beam.logits), min(self.num_beams, beam.logits.numel()))
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                if value > float("-inf"):
                    candidates.append((beam.score + value, index, token, value))
        candidates.sort(key=lambda c: -c[0])
        self.beams = [self._extend(self.beams[i], token, lp) for _, i, token, lp in candidates[: self.num_beams]]
        size = sum(buffer_bytes(t) for b in self.beams for t in b.k + b.v)
        self.peak_beam_bytes = max(self.peak_beam_bytes, size)

    def _commit(self) -> int:
        best = max(self.beams, key=lambda b: b.score)
        token = best.tokens[0]
        cache = self.lane.cache
        for layer in range(len(cache.k)):
            cache.k[layer][:, :, self.base].copy_(best.k[layer][:, :, 0])
            cache.v[layer][:, :, self.base].copy_(best.v[layer][:, :, 0])
        del cache.tokens[self.base :]
        cache.tokens.append(token)
        self.base += 1
        cache.seq_len = self.base
        self.logprob += best.logprobs[0]
        self.beams = [Beam(b.tokens[1:], b.logprobs[1:], b.logits, [t[:, :, 1:] for t in b.k],
                           [t[:, :, 1:] for t in b.v]) for b in self.beams if b.tokens[0] == token]
        return token
