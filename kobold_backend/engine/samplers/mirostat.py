"""Mirostat 1 and 2 (KoboldCpp / llama.cpp): truncation steered by a running target surprise mu.

mu lives on the device as a 0-d tensor; `update_mu` applies mu <- mu - eta * (surprise - tau) after the
draw, with the surprise -log2 p of the chosen token under the truncated, renormalised distribution.
"""

from __future__ import annotations

import torch

from kobold_backend.engine.samplers.candidates import Candidates

# Mirostat 1 estimates the Zipf exponent from this many of the most likely tokens.
MIROSTAT_M = 100


def mirostat_v1(c: Candidates, mu: torch.Tensor, vocab_size: int) -> None:
    """Estimate s_hat from the top tokens, then keep the top k = ((e * 2^mu) / (1 - N^-e))^(1/s_hat), e = s_hat - 1.

    N is the vocabulary size. Ratios with a zero probability are left out of the estimate; a k that
    is not finite keeps every candidate; k is clamped to [1, candidates]. On the host only the top
    m and then the top k are selected, instead of sorting everything.
    """
    n = c.vals.numel()
    m = min(MIROSTAT_M, n)
    if m < 2:
        return
    probs = c.probs()
    if c.host and not c.sorted:
        top = torch.topk(probs, m).values
    else:
        c.sort()
        probs = c.probs()
        top = probs[:m]
    i = torch.arange(m - 1, device=probs.device, dtype=probs.dtype)
    t = torch.log((i + 2.0) / (i + 1.0))
    valid = top[1:] > 0
    b = torch.where(valid, torch.log(top[:-1] / top[1:]), torch.zeros_like(t))
    t = torch.where(valid, t, torch.zeros_like(t))
    s_hat = (t * b).sum() / (t * t).sum()
    eps = s_hat - 1.0
    k = torch.pow((eps * torch.pow(2.0, mu)) / (1.0 - torch.pow(float(vocab_size), -eps)), 1.0 / s_hat)
    k = torch.where(torch.isfinite(k), k, torch.full_like(k, float(n))).floor().clamp(1.0, float(n))
    if c.host and not c.sorted:
        c.select(torch.topk(c.vals, int(k)).indices, now_sorted=True)
        return
    positions = torch.arange(n, device=probs.device, dtype=probs.dtype)
    c.remove(positions >= k, suffix=True)


def mirostat_v2(c: Candidates, mu: torch.Tensor) -> None:
    """Remove tokens with surprise -log2 p > mu, keeping at least the most likely one."""
    probs = c.probs()
    positions = torch.arange(probs.numel(), device=probs.device)
    remove = (probs < torch.pow(2.0, -mu)) & (positions != torch.argmax(c.vals))
    c.remove(remove, suffix=True)


def update_mu(mu: torch.Tensor, chosen_prob: torch.Tensor, tau: float, eta: float) -> torch.Tensor:
    """mu - eta * (-log2 p_chosen - tau)."""
    surprise = -torch.log2(chosen_prob.reshape(()))
    return mu - eta * (surprise - tau)

