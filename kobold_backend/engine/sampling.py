"""Token sampling: SamplerSettings (KoboldAI United and KoboldCpp fields) and the Sampler over logits.

This first version implements the final interface with logit bias, bans, temperature, top-k and top-p;
the remaining samplers follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import torch

from kobold_backend.errors import RequestError

REP_PEN_MODES = ("kobold_united", "koboldcpp")


@dataclass
class SamplerSettings:
    """Every sampling field of KoboldAI United and KoboldCpp; each default switches its sampler off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    top_a: float = 0.0
    tfs: float = 1.0
    typical: float = 1.0
    min_p: float = 0.0
    rep_pen: float = 1.0
    rep_pen_range: int = 0
    rep_pen_slope: float = 1.0
    rep_pen_mode: str = "kobold_united"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    sampler_order: Tuple[int, ...] = (6, 0, 1, 3, 4, 2, 5)
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    smoothing_factor: float = 0.0
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 0
    dry_sequence_breakers: Tuple[str, ...] = ("\n", ":", '"', "*")
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0
    logit_bias: Dict[int, float] = field(default_factory=dict)
    banned_token_ids: Tuple[int, ...] = ()

    def validate(self) -> None:
        """Raise RequestError(message, field) for the first out-of-range value."""
        if self.rep_pen_mode not in REP_PEN_MODES:
            raise RequestError(f"rep_pen_mode must be one of {REP_PEN_MODES}", "rep_pen_mode")
        if self.top_k < 0:
            raise RequestError("top_k must be >= 0", "top_k")
        if not 0.0 <= self.top_p <= 1.0:
            raise RequestError("top_p must be in [0, 1]", "top_p")
        if self.top_a < 0.0:
            raise RequestError("top_a must be >= 0", "top_a")
        if not 0.0 <= self.tfs <= 1.0:
            raise RequestError("tfs must be in [0, 1]", "tfs")
        if not 0.0 <= self.typical <= 1.0:
            raise RequestError("typical must be in [0, 1]", "typical")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError("min_p must be in [0, 1]", "min_p")
        if self.rep_pen < 1.0:
            raise RequestError("rep_pen must be >= 1", "rep_pen")
        if self.rep_pen_range < 0:
            raise RequestError("rep_pen_range must be >= 0", "rep_pen_range")
        if self.mirostat not in (0, 1, 2):
            raise RequestError("mirostat must be 0, 1 or 2", "mirostat")
        for sid in self.sampler_order:
            if sid not in range(7):
                raise RequestError("sampler_order ids must be in 0..6", "sampler_order")
        if len(set(self.sampler_order)) != len(self.sampler_order):
            raise RequestError("sampler_order has a repeated id", "sampler_order")


class Sampler:
    """Applies the configured samplers to one logits vector per token and keeps the per-request state."""

    def __init__(
        self,
        settings: SamplerSettings,
        vocab_size: int,
        device: Union[torch.device, str] = "cpu",
        seed: Optional[int] = None,
        token_texts: Optional[List[str]] = None,
    ) -> None:
        settings.validate()
        self.settings = settings
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.token_texts = token_texts
        self.generator = torch.Generator(device=self.device)
        if seed is None or seed < 0:
            self.generator.seed()
        else:
            self.generator.manual_seed(int(seed))
        self.context: List[int] = []
        self._bias = torch.zeros(vocab_size, dtype=torch.float32, device=self.device)
        for tid, b in settings.logit_bias.items():
            if 0 <= int(tid) < vocab_size:
                self._bias[int(tid)] += max(-100.0, min(100.0, float(b)))
        banned = [t for t in settings.banned_token_ids if 0 <= t < vocab_size]
        if banned:
            self._bias[torch.tensor(banned, dtype=torch.long, device=self.device)] = float("-inf")

    def begin(self, context_ids: List[int]) -> None:
        """Start a request on this prompt; resets all incremental state."""
        self.context = list(context_ids)

    def accept(self, token_id: int) -> None:
        """Append a generated (or forced) token to the context."""
        self.context.append(int(token_id))

    def rewind(self, n: int) -> None:
        """Forget the last n accepted tokens."""
        if n > 0:
            del self.context[-n:]

    def sample(self, logits: torch.Tensor) -> int:
        """Pick the next token id from raw logits [V]."""
        s = self.settings
        x = logits.to(self.device, torch.float32) + self._bias
        if s.temperature <= 0.0:
            return int(torch.argmax(x).item())
        if s.top_k > 0:
            kth = torch.topk(x, min(s.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if s.top_p < 1.0:
            sx, idx = torch.sort(x)
            cum = torch.softmax(sx, dim=-1).cumsum(-1)
            remove = cum <= 1.0 - s.top_p
            remove[-1] = False
            x = x.scatter(0, idx, sx.masked_fill(remove, float("-inf")))
        x = x / s.temperature
        probs = torch.softmax(x, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())
