"""Temperature (sampler id 5): plain, greedy, KoboldCpp's dynamic temperature and quadratic smoothing."""

from __future__ import annotations

import torch

from kobold_backend.engine.samplers.candidates import Candidates

# KoboldCpp's stand-in for a zero temperature; also the floor of a dynamic temperature.
MIN_TEMPERATURE = 1.0 / 256.0


def greedy(c: Candidates) -> None:
    """Keep only the single most likely token (the first in working order among equal maxima)."""
    best = torch.argmax(c.vals).reshape(1)
    if c.host:
        c.select(best, now_sorted=True)
        return
    positions = torch.arange(c.vals.numel(), device=c.vals.device)
    c.remove(positions != best, suffix=False)


def smooth(c: Candidates, factor: float) -> None:
    """Quadratic smoothing: l -> h - factor * (l - h)^2 with h the largest logit (order preserved)."""
    h = c.vals.max()
    c.vals = h - factor * (c.vals - h).square()


def divide(vals: torch.Tensor, temp: float) -> torch.Tensor:
    """`vals / temp`; where that overflows float32 (a temperature such as 1e-300), the logits are first shifted so
    that the largest is 0: the same distribution (the top tokens share it), with no inf - inf to make NaN."""
    out = vals / temp
    overflow = (torch.isinf(out) & torch.isfinite(vals)).any()
    top = vals.max()
    shifted = torch.where(vals == top, torch.zeros_like(vals), (vals - top) / temp)
    return torch.where(overflow, shifted, out)


def temperature(c: Candidates, temp: float, smoothing_factor: float) -> None:
    """Divide by the temperature, then smooth when smoothing_factor > 0 (temp must be > 0)."""
    if temp != 1.0:
        c.vals = divide(c.vals, temp)
    if smoothing_factor > 0.0:
        smooth(c, smoothing_factor)


def dynamic_temperature(
    c: Candidates, temp: float, spread: float, exponent: float, smoothing_factor: float
) -> None:
    """KoboldCpp's entropy-scaled temperature T = lo + (hi - lo) * (H / ln N)^exponent.

    lo = max(0, temp - spread), hi = max(0, temp + spread), N = the number of candidates left and H
    their entropy; a negative exponent counts as 0. With one candidate nothing changes.
    """
    lo = max(0.0, temp - spread)
    hi = max(0.0, temp + spread)
    exponent = max(0.0, exponent)
    probs = c.probs()
    finite = torch.isfinite(c.vals)
    count = finite.sum()
    entropy = -(probs * probs.log()).nan_to_num(nan=0.0).sum()
    max_entropy = torch.log(count.to(probs.dtype)).clamp_min(torch.finfo(probs.dtype).tiny)
    dyn = lo + (hi - lo) * torch.pow((entropy / max_entropy).clamp(0.0, 1.0), exponent)
    dyn = dyn.clamp_min(MIN_TEMPERATURE)
    scaled = c.vals / dyn
    if smoothing_factor > 0.0:
        h = scaled.max()
        scaled = h - smoothing_factor * (scaled - h).square()
    c.vals = torch.where(count > 1, scaled, c.vals)

