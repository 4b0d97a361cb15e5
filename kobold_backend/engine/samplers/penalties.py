"""Repetition penalty (sampler id 6) with presence and frequency penalties, from state kept on the device.

Two rules (see docs/samplers.md): KoboldAI United's curve ("kobold_united") and KoboldCpp's half-window
rule ("koboldcpp"). Both only need, per vocabulary token, the position of its newest occurrence; the
frequency penalty also keeps per-token counts over the window. Both are updated per accepted token.
In vocabulary order only the window's tokens are touched; in a sorted/compacted order the per-token
state is gathered for the candidates instead.
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch

from kobold_backend.engine.samplers.candidates import Candidates


class RepetitionPenalty:
    """Per-token newest-occurrence positions and window counts; applies slot 6 to a Candidates set."""

    def __init__(
        self,
        mode: str,
        rep_pen: float,
        rep_pen_range: int,
        rep_pen_slope: float,
        presence_penalty: float,
        frequency_penalty: float,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.mode = mode
        self.rep_pen = rep_pen
        self.range = rep_pen_range if mode == "kobold_united" else max(rep_pen_range, 1)
        self.slope = rep_pen_slope
        self.presence = presence_penalty
        self.frequency = frequency_penalty
        self.vocab_size = vocab_size
        self.device = device
        self.active = rep_pen != 1.0 or presence_penalty != 0.0 or frequency_penalty != 0.0
        self.reduced = 1.0 + (rep_pen - 1.0) * rep_pen_slope if rep_pen > 1.0 else rep_pen
        self.curved = mode == "kobold_united" and self.range > 0 and rep_pen_slope != 0.0
        # Computed on the device when first needed and only as long as the window has been, so that a
        # huge rep_pen_range costs nothing: the newest entries of United's curve, and KoboldCpp's
        # factors over a full window (both oldest first).
        self._curve: Optional[torch.Tensor] = None
        self._halves: Optional[torch.Tensor] = None
        self._zero = torch.zeros(1, dtype=torch.float32, device=device)
        # Index vocab_size collects ids outside the vocabulary so that no update can go out of bounds.
        self._last_pos = torch.full((vocab_size + 1,), -1, dtype=torch.long, device=device)
        self._counts: Optional[torch.Tensor] = None
        if frequency_penalty != 0.0:
            self._counts = torch.zeros(vocab_size + 1, dtype=torch.float32, device=device)
        # Device copy of the context (ids outside the vocabulary as vocab_size) and position numbers.
        self._hist = torch.empty(0, dtype=torch.long, device=device)
        self._positions = torch.empty(0, dtype=torch.long, device=device)
        self._length = 0

    def window(self, length: int) -> int:
        """How many of the newest tokens the penalty looks at, for a context of `length` tokens."""
        if self.range <= 0:
            return length
        return min(length, self.range)

    def _slot(self, token: int) -> int:
        return token if 0 <= token < self.vocab_size else self.vocab_size

    def _reserve(self, length: int, keep: int) -> None:
        """Room for `length` history positions, keeping the first `keep`."""
        if length <= self._hist.numel():
            return
        capacity = max(1024, 2 * length)
        hist = torch.full((capacity,), self.vocab_size, dtype=torch.long, device=self.device)
        hist[:keep] = self._hist[:keep]
        self._hist = hist
        self._positions = torch.arange(capacity, dtype=torch.long, device=self.device)

    def reset(self, context: List[int]) -> None:
        """Rebuild the state for a whole context (begin, rewind)."""
        self._length = len(context)
        if not self.active:
            return
        self._last_pos.fill_(-1)
        self._reserve(len(context), 0)
        if context:
            ids = torch.tensor([self._slot(t) for t in context], dtype=torch.long, device=self.device)
            self._hist[: len(context)] = ids
            self._last_pos.scatter_reduce_(0, ids, self._positions[: len(context)], "amax")
            if self._counts is not None:
                w = self.window(len(context))
                self._counts.zero_()
                self._counts.index_add_(0, ids[len(context) - w :], torch.ones(w, device=self.device))

    def push(self, context: List[int]) -> None:
        """Account for context[-1], just appended."""
        self._length = len(context)
        if not self.active:
            return
        token = self._slot(context[-1])
        self._reserve(self._length, self._length - 1)
        # Scalar writes go through fill_/add_ on one-element views: item assignment would copy a host
        # scalar to the device, which synchronises.
        self._hist[self._length - 1 : self._length].fill_(token)
        self._last_pos[token : token + 1].fill_(self._length - 1)
        if self._counts is not None:
            self._counts[token : token + 1].add_(1.0)
            if self.range > 0 and self._length > self.range:
                leaving = self._slot(context[-1 - self.range])
                self._counts[leaving : leaving + 1].sub_(1.0)

    def apply(self, c: Candidates) -> None:
        """Penalise the candidates that occur in the window."""
        length = self._length
        w = self.window(length)
        if not self.active or w == 0:
            return
        if c.ids is None:
            self._apply_window(c, length, w)
        else:
            last_pos = c.per_token(self._last_pos[: self.vocab_size])
            distance = (length - 1) - last_pos
            in_window = (last_pos >= 0) & (distance < w)
            counts = None if self._counts is None else c.per_token(self._counts[: self.vocab_size])
            c.vals = self._penalise(c.vals, distance, in_window, counts, w)
        c.sorted = False

    def _half_window(self, w: int) -> torch.Tensor:
        """KoboldCpp: window index i (oldest 0) is in the newer half when 2i >= w."""
        newer = torch.arange(w, device=self.device) * 2 >= w
        return torch.full((w,), self.reduced, dtype=torch.float32, device=self.device).masked_fill_(newer, self.rep_pen)

    def _curve_tail(self, w: int) -> torch.Tensor:
        """The newest w entries of United's curve, oldest first (the newest is rep_pen).

        x_i = 2i/(range-1) - 1, y_i = slope x_i / (1 + |x_i| (slope - 1)), P_i = 1 + (y_i + 1)/2 (P - 1);
        a range of 1 is just P.
        """
        have = 0 if self._curve is None else self._curve.numel()
        if have < w:
            n = min(self.range, max(w, 2 * have, 1024))
            if self.range == 1:
                curve = torch.full((1,), self.rep_pen, dtype=torch.float64, device=self.device)
            else:
                i = torch.arange(self.range - n, self.range, dtype=torch.float64, device=self.device)
                x = i / (self.range - 1) * 2.0 - 1.0
                y = self.slope * x / (1.0 + x.abs() * (self.slope - 1.0))
                curve = 1.0 + (y + 1.0) / 2.0 * (self.rep_pen - 1.0)
            self._curve = curve.to(torch.float32)
            have = n
        assert self._curve is not None
        return self._curve[have - w :]

    def _window_factors(self, w: int) -> Union[torch.Tensor, float, None]:
        """The multiplicative penalty of each window position, oldest first (a float when uniform)."""
        if self.rep_pen == 1.0:
            return None
        if self.mode == "kobold_united":
            return self._curve_tail(w) if self.curved else self.rep_pen
        if w < self.range:
            return self._half_window(w)
        if self._halves is None:
            self._halves = self._half_window(w)
        return self._halves

    def _apply_window(self, c: Candidates, length: int, w: int) -> None:
        """Vocabulary order: touch only the window's tokens, each once at its newest position."""
        start = length - w
        tokens = self._hist[start:length]
        newest = self._last_pos[tokens] == self._positions[start:length]
        index = torch.where(newest, tokens, self.vocab_size)
        padded = torch.cat((c.vals, self._zero))
        vals = padded[index]
        factor = self._window_factors(w)
        if factor is not None:
            vals = torch.where(vals <= 0, vals * factor, vals / factor)
        if self.presence != 0.0:
            vals = vals - self.presence
        if self._counts is not None:
            vals = vals - self.frequency * self._counts[index]
        padded[index] = vals
        c.vals = padded[: self.vocab_size]

    def _penalise(
        self, vals: torch.Tensor, distance: torch.Tensor, in_window: torch.Tensor, counts: Optional[torch.Tensor],
        w: int,
    ) -> torch.Tensor:
        """The slot-6 arithmetic on logits gathered in working order, from each token's newest position."""
        inside = in_window.to(vals.dtype)
        if self.rep_pen != 1.0:
            if self.mode == "kobold_united":
                if self.curved:
                    index = (w - 1 - distance).clamp(0, w - 1)
                    factor = 1.0 + (self._curve_tail(w)[index] - 1.0) * inside
                else:
                    factor = 1.0 + (self.rep_pen - 1.0) * inside
            else:
                near = (2 * distance + 2 <= w).to(vals.dtype) * inside
                factor = 1.0 + (self.reduced - 1.0) * inside + (self.rep_pen - self.reduced) * near
            vals = torch.where(vals <= 0, vals * factor, vals / factor)
        if self.presence != 0.0:
            vals = vals - self.presence * inside
        if counts is not None:
            vals = vals - self.frequency * counts
        return vals
