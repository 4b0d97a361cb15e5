"""Truncation samplers of KoboldAI United (top-k, top-a, top-p, tail-free, typical) and KoboldCpp's min-p.

Each narrows a Candidates set in place, following `modeling/warpers.py` (torch path) and always keeping
at least the most likely token (United itself can remove everything at extreme values). Cumulative
sums run in float64 so that cuts near p = 1 do not depend on float32 rounding of the tail.
"""

from __future__ import annotations

import math

import torch

from kobold_backend.engine.samplers.candidates import Candidates

# Host top-p: below this many candidates a full sort is cheap; above, top-k slices grow from this size.
PARTIAL_SORT_MIN = 4096
PARTIAL_SORT_START = 256


def top_k(c: Candidates, k: int) -> None:
    """Keep the k largest logits; logits equal to the k-th largest are kept too."""
    k = min(max(k, 1), c.vals.numel())
    kth = c.vals[k - 1] if c.sorted else torch.topk(c.vals, k).values[-1]
    c.remove(c.vals < kth, suffix=True)


def top_a(c: Candidates, a: float) -> None:
    """Remove tokens with p < a * max(p)^2."""
    p = c.probs()
    pmax = p.max()
    c.remove((p < a * pmax * pmax) & (p < pmax), suffix=True)


def top_p(c: Candidates, p: float) -> None:
    """Remove the tokens whose ascending cumulative probability is <= 1 - p.

    That is 1 - (mass of the strictly more likely tokens) <= 1 - p, evaluated as "mass before >= p"
    on the descending order. On the host an unsorted set is not fully sorted: the top k (k = 256,
    1024, ...) are taken until they hold p of the mass, which leaves the same tokens.
    """
    n = c.vals.numel()
    if c.host and not c.sorted and n > PARTIAL_SORT_MIN:
        probs = c.probs64()
        k = PARTIAL_SORT_START
        while True:
            top_vals, positions = torch.topk(c.vals, min(k, n))
            top_probs = probs[positions]
            if k >= n or float(top_probs.sum()) >= p:
                break
            k *= 4
        before = top_probs.cumsum(0) - top_probs
        keep = before < p
        keep[:1].fill_(True)
        c.select(positions[keep], now_sorted=True)
        return
    c.sort()
    probs = c.probs64()
    before = probs.cumsum(0) - probs
    remove = before >= p
    remove[:1].fill_(False)
    c.remove(remove, suffix=True)


def min_p(c: Candidates, p: float) -> None:
    """Keep tokens with logit >= max logit + ln(p), i.e. probability >= p * max probability."""
    top = c.vals.max()
    c.remove(c.vals < top + math.log(p), suffix=True)


def tail_free(c: Candidates, z: float) -> None:
    """Tail-free sampling: normalised |second difference| of the sorted probabilities, cut where its CDF > z.

    United's mask over the whole sorted vocabulary is [False] + (cdf > z) + [True]: the first token is
    kept and the last removed. Tokens already dropped from a compacted set count as the zeros they
    are (up to two of them change the differences). Fewer than three tokens: no-op (KoboldCpp's rule;
    United's diff is undefined there). An all-zero second difference keeps everything but the last
    token, as United's NaN comparison does.
    """
    c.sort()
    probs = c.probs64()
    n = probs.numel()
    pad = min(2, c.dropped)
    if n + pad < 3:
        return
    if pad:
        probs = torch.cat((probs, probs.new_zeros(pad)))
    d2 = (probs[:-2] - 2.0 * probs[1:-1] + probs[2:]).abs()
    total = d2.sum()
    cdf = (d2 / total.clamp_min(torch.finfo(d2.dtype).tiny)).cumsum(0)
    remove = torch.ones(n + pad, dtype=torch.bool, device=c.vals.device)
    remove[:1].fill_(False)
    remove[1:-1] = (cdf > z) & (total > 0)
    c.remove(remove[:n], suffix=True)


def typical(c: Candidates, tau: float) -> None:
    """Locally typical sampling: sort by |-ln p - H|, keep the shortest prefix whose mass reaches tau."""
    probs = c.probs64()
    log_probs = probs.log()
    neg_entropy = torch.nansum(probs * log_probs)
    deviation = (neg_entropy - log_probs).abs()
    _, order = torch.sort(deviation, stable=True)
    cum = probs[order].cumsum(0)
    remove_sorted = (cum >= tau).roll(1, 0)
    remove_sorted[:1].fill_(False)
    remove = torch.empty_like(remove_sorted)
    remove[order] = remove_sorted
    c.remove(remove, suffix=False)
