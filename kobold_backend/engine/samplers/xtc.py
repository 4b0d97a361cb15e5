"""XTC ("exclude top choices"), KoboldCpp's last step before the draw."""

from __future__ import annotations

import torch

from kobold_backend.engine.samplers.candidates import Candidates

# KoboldCpp lowers excluded logits by this much instead of using -inf.
XTC_DROP = 999.0


def xtc_enabled(threshold: float, probability: float) -> bool:
    """XTC runs when probability > 0 and threshold <= 0.5."""
    return probability > 0.0 and threshold <= 0.5


def xtc(c: Candidates, threshold: float, probability: float, generator: torch.Generator) -> None:
    """With one roll < probability: if >= 2 tokens have p >= threshold, lower all but the least likely of them.

    The roll is drawn from `generator` on every call, so each token consumes exactly one number.
    """
    roll = torch.rand(1, generator=generator, device=c.vals.device)
    probs = c.probs()
    above = probs >= threshold
    least = torch.argmin(torch.where(above, probs, torch.full_like(probs, 2.0)))
    positions = torch.arange(probs.numel(), device=probs.device)
    hit = above & (positions != least) & (above.sum() >= 2) & (roll < probability)
    c.vals = torch.where(hit, c.vals - XTC_DROP, c.vals)
    c.sorted = False
