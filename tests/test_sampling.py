"""Sampler pipeline tests: each KoboldAI/KoboldCpp sampler, the order, XTC, mirostat and the draw vs NumPy.

The oracle below is a plain float64 NumPy transcription of the spec formulas (host-protocol.md section 4
for ids 0-6, passthrough-and-clients.md section C for min-p, dynatemp, smoothing, XTC and mirostat).
Every test runs both the CPU path (compaction) and the fixed-shape accelerator path on the CPU.
"""

from __future__ import annotations

import itertools
import math
from typing import Dict, List, Sequence

import numpy as np
import pytest
import torch

from kobold_backend.engine.sampling import (
    Sampler,
    SamplerSettings,
    benchmark_samplers,
    parse_sequence_breakers,
)
from kobold_backend.errors import RequestError

NEG = -np.inf
V = 1000


# ----------------------------------------------------------------------------- NumPy oracle (float64)


def softmax(s: np.ndarray) -> np.ndarray:
    out = np.zeros_like(s)
    finite = np.isfinite(s)
    if finite.any():
        e = np.exp(s[finite] - s[finite].max())
        out[finite] = e / e.sum()
    return out


def ref_top_k(s: np.ndarray, k: int) -> np.ndarray:
    k = min(max(k, 1), s.size)
    kth = np.sort(s)[::-1][k - 1]
    return np.where(s < kth, NEG, s)


def ref_top_a(s: np.ndarray, a: float) -> np.ndarray:
    p = softmax(s)
    remove = (p < a * p.max() ** 2) & (p < p.max())
    return np.where(remove, NEG, s)


def ref_top_p(s: np.ndarray, top_p: float) -> np.ndarray:
    """United: sort ascending, remove where cumulative softmax <= 1 - top_p (a top token stays if all would go)."""
    order = np.argsort(s, kind="stable")
    cum = np.cumsum(softmax(s)[order])
    remove = np.zeros(s.size, dtype=bool)
    remove[order] = cum <= 1.0 - top_p
    if remove.all():
        remove[np.argmax(s)] = False
    return np.where(remove, NEG, s)


def ref_min_p(s: np.ndarray, m: float) -> np.ndarray:
    return np.where(s < s[np.isfinite(s)].max() + math.log(m), NEG, s)


def ref_tfs(s: np.ndarray, z: float) -> np.ndarray:
    """United: sorted descending, d2 = |diff(diff(p))| normalised; mask [False] + (cdf > z) + [True]."""
    if s.size < 3:
        return s
    order = np.argsort(-s, kind="stable")
    p = softmax(s)[order]
    d2 = np.abs(np.diff(np.diff(p)))
    with np.errstate(invalid="ignore", divide="ignore"):
        cdf = np.cumsum(d2 / d2.sum())
    remove_sorted = np.concatenate([[False], cdf > z, [True]])
    remove = np.zeros(s.size, dtype=bool)
    remove[order] = remove_sorted
    return np.where(remove, NEG, s)


def ref_typical(s: np.ndarray, tau: float) -> np.ndarray:
    """United: sort by |H' - ln p| ascending (H' = sum p ln p); remove cum >= tau shifted right by one."""
    p = softmax(s)
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(p)
        neg_entropy = np.nansum(p * logp)
    deviation = np.abs(neg_entropy - logp)
    order = np.argsort(deviation, kind="stable")
    remove_sorted = np.roll(np.cumsum(p[order]) >= tau, 1)
    remove_sorted[0] = False
    remove = np.zeros(s.size, dtype=bool)
    remove[order] = remove_sorted
    return np.where(remove, NEG, s)


def ref_smooth(s: np.ndarray, factor: float) -> np.ndarray:
    h = s[np.isfinite(s)].max()
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(s), h - factor * (s - h) ** 2, NEG)


def ref_temperature(s: np.ndarray, t: float, smoothing: float) -> np.ndarray:
    s = s / t
    return ref_smooth(s, smoothing) if smoothing > 0 else s


def ref_dynatemp(s: np.ndarray, t: float, spread: float, exponent: float, smoothing: float) -> np.ndarray:
    """KoboldCpp: T = lo + (hi - lo) * (H / ln N)^exp over the N remaining candidates."""
    n = int(np.isfinite(s).sum())
    if n <= 1:
        return s
    lo, hi = max(0.0, t - spread), max(0.0, t + spread)
    p = softmax(s)
    nz = p[p > 0]
    entropy = -np.sum(nz * np.log(nz))
    temp = lo + (hi - lo) * (entropy / math.log(n)) ** max(0.0, exponent)
    s = s / temp
    return ref_smooth(s, smoothing) if smoothing > 0 else s


def ref_greedy(s: np.ndarray) -> np.ndarray:
    out = np.full_like(s, NEG)
    out[np.argmax(s)] = s[np.argmax(s)]
    return out


def ref_xtc(s: np.ndarray, threshold: float) -> np.ndarray:
    """All tokens with p >= threshold except the least likely get -999, when there are at least two."""
    p = softmax(s)
    above = np.flatnonzero(p >= threshold)
    if above.size < 2:
        return s
    least = above[np.argmin(p[above])]
    out = s.copy()
    out[above[above != least]] -= 999.0
    return out


def ref_pipeline(s: np.ndarray, cfg: Dict[str, float], order: Sequence[int]) -> np.ndarray:
    """The samplers of `order` (no penalties in this file), then XTC when probability is 1."""
    s = s.astype(np.float64)
    for sid in order:
        if sid == 0 and cfg.get("top_k", 0) > 0:
            s = ref_top_k(s, cfg["top_k"])
        elif sid == 1 and cfg.get("top_a", 0) > 0:
            s = ref_top_a(s, cfg["top_a"])
        elif sid == 2:
            if cfg.get("top_p", 1) < 1:
                s = ref_top_p(s, cfg["top_p"])
            if cfg.get("min_p", 0) > 0:
                s = ref_min_p(s, cfg["min_p"])
        elif sid == 3 and cfg.get("tfs", 1) < 1:
            s = ref_tfs(s, cfg["tfs"])
        elif sid == 4 and cfg.get("typical", 1) < 1:
            s = ref_typical(s, cfg["typical"])
        elif sid == 5:
            t = cfg.get("temperature", 1.0)
            if t <= 0:
                return ref_greedy(s)
            if cfg.get("dynatemp_range", 0) > 0:
                s = ref_dynatemp(s, t, cfg["dynatemp_range"], cfg.get("dynatemp_exponent", 1.0),
                                 cfg.get("smoothing_factor", 0.0))
            elif t != 1 or cfg.get("smoothing_factor", 0) > 0:
                s = ref_temperature(s, t, cfg.get("smoothing_factor", 0.0))
    if cfg.get("xtc_probability", 0) >= 1 and cfg.get("xtc_threshold", 0.1) <= 0.5:
        s = ref_xtc(s, cfg.get("xtc_threshold", 0.1))
    return s


# ----------------------------------------------------------------------------- helpers


def make_sampler(cfg: Dict[str, object], vocab: int = V, compact: bool = True, seed: int = 0, **kw) -> Sampler:
    sampler = Sampler(SamplerSettings(**cfg), vocab, "cpu", seed=seed, **kw)
    sampler.compact = compact
    return sampler


def assert_same_logits(got: torch.Tensor, want: np.ndarray, rtol: float = 2e-5, atol: float = 2e-4) -> None:
    got_np = got.double().numpy()
    np.testing.assert_array_equal(np.isfinite(got_np), np.isfinite(want), err_msg="kept sets differ")
    finite = np.isfinite(want)
    np.testing.assert_allclose(got_np[finite], want[finite], rtol=rtol, atol=atol)


def assert_same_kept_values(got: torch.Tensor, want: np.ndarray) -> None:
    """Tie-invariant comparison: the same multiset of surviving values (which tied token survives is free)."""
    got_np = got.double().numpy()
    np.testing.assert_allclose(np.sort(got_np[np.isfinite(got_np)]), np.sort(want[np.isfinite(want)]),
                               rtol=2e-5, atol=2e-4)


def random_logits(seed: int, vocab: int = V, scale: float = 3.0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=vocab) * scale


COMPACT = pytest.mark.parametrize("compact", [True, False], ids=["host", "fixed"])

SINGLE = [
    ({"top_k": 1}, lambda s: ref_top_k(s, 1)),
    ({"top_k": 7}, lambda s: ref_top_k(s, 7)),
    ({"top_k": 50}, lambda s: ref_top_k(s, 50)),
    ({"top_k": 5000}, lambda s: ref_top_k(s, 5000)),
    ({"top_a": 0.05}, lambda s: ref_top_a(s, 0.05)),
    ({"top_a": 0.5}, lambda s: ref_top_a(s, 0.5)),
    ({"top_p": 0.3}, lambda s: ref_top_p(s, 0.3)),
    ({"top_p": 0.9}, lambda s: ref_top_p(s, 0.9)),
    ({"top_p": 0.999}, lambda s: ref_top_p(s, 0.999)),
    ({"min_p": 0.01}, lambda s: ref_min_p(s, 0.01)),
    ({"min_p": 0.2}, lambda s: ref_min_p(s, 0.2)),
    ({"tfs": 0.5}, lambda s: ref_tfs(s, 0.5)),
    ({"tfs": 0.9}, lambda s: ref_tfs(s, 0.9)),
    ({"tfs": 0.99}, lambda s: ref_tfs(s, 0.99)),
    ({"typical": 0.2}, lambda s: ref_typical(s, 0.2)),
    ({"typical": 0.9}, lambda s: ref_typical(s, 0.9)),
    ({"temperature": 0.3}, lambda s: ref_temperature(s, 0.3, 0.0)),
    ({"temperature": 1.7}, lambda s: ref_temperature(s, 1.7, 0.0)),
    ({"temperature": 0.8, "smoothing_factor": 0.25}, lambda s: ref_temperature(s, 0.8, 0.25)),
    ({"smoothing_factor": 0.1}, lambda s: ref_temperature(s, 1.0, 0.1)),
    ({"temperature": 0.8, "dynatemp_range": 0.5}, lambda s: ref_dynatemp(s, 0.8, 0.5, 1.0, 0.0)),
    ({"temperature": 0.8, "dynatemp_range": 0.5, "dynatemp_exponent": 2.5},
     lambda s: ref_dynatemp(s, 0.8, 0.5, 2.5, 0.0)),
    ({"temperature": 0.2, "dynatemp_range": 0.6, "smoothing_factor": 0.3},
     lambda s: ref_dynatemp(s, 0.2, 0.6, 1.0, 0.3)),
]

SAMPLER_SLOT = {"top_k": 0, "top_a": 1, "top_p": 2, "min_p": 2, "tfs": 3, "typical": 4}


def slot_of(cfg: Dict[str, object]) -> int:
    for key, slot in SAMPLER_SLOT.items():
        if key in cfg:
            return slot
    return 5


# ----------------------------------------------------------------------------- single samplers


@COMPACT
@pytest.mark.parametrize("cfg,ref", SINGLE, ids=[str(c) for c, _ in SINGLE])
def test_each_sampler_matches_numpy(cfg: Dict[str, object], ref, compact: bool) -> None:
    sampler = make_sampler(dict(cfg, sampler_order=(slot_of(cfg),)), compact=compact)
    for draw in range(4):
        s = random_logits(100 + draw)
        assert_same_logits(sampler.warp(torch.tensor(s, dtype=torch.float32)), ref(s))


@COMPACT
@pytest.mark.parametrize("cfg,ref", SINGLE, ids=[str(c) for c, _ in SINGLE])
def test_each_sampler_after_a_truncation(cfg: Dict[str, object], ref, compact: bool) -> None:
    """Behind top-k the candidates are already cut (and compacted on the host), which TFS must still see."""
    slot = slot_of(cfg)
    if slot == 0:
        pytest.skip("top-k after top-k")
    sampler = make_sampler(dict(cfg, top_k=40, sampler_order=(0, slot)), compact=compact)
    for draw in range(3):
        s = random_logits(200 + draw)
        assert_same_logits(sampler.warp(torch.tensor(s, dtype=torch.float32)), ref(ref_top_k(s, 40)))


@COMPACT
def test_top_p_partial_sort_on_a_large_vocabulary(compact: bool) -> None:
    """Above 4096 candidates the host path takes growing top-k slices instead of a full sort."""
    for top_p, scale in ((0.9, 3.0), (0.95, 0.5), (0.5, 0.05)):
        sampler = make_sampler({"top_p": top_p, "sampler_order": (2,)}, vocab=20000, compact=compact)
        s = random_logits(7, vocab=20000, scale=scale)
        assert_same_logits(sampler.warp(torch.tensor(s, dtype=torch.float32)), ref_top_p(s, top_p))


# ----------------------------------------------------------------------------- order

ALL_TRUNCATIONS = {
    "top_k": 120, "top_a": 0.01, "top_p": 0.9, "min_p": 0.02, "tfs": 0.95, "typical": 0.9,
    "temperature": 0.6, "smoothing_factor": 0.1,
}
ORDERS = [
    (6, 0, 1, 3, 4, 2, 5),  # KoboldCpp default
    (6, 0, 1, 2, 3, 4, 5),  # United default
    (5, 4, 3, 2, 1, 0, 6),
    (5, 0, 2),
    (0, 2, 5),
    (4, 3, 5),
    (3, 4, 5),
]


@COMPACT
@pytest.mark.parametrize("order", ORDERS, ids=[str(o) for o in ORDERS])
def test_order_is_honoured(order: Sequence[int], compact: bool) -> None:
    sampler = make_sampler(dict(ALL_TRUNCATIONS, sampler_order=order), compact=compact)
    for draw in range(3):
        s = random_logits(300 + draw)
        assert_same_logits(sampler.warp(torch.tensor(s, dtype=torch.float32)), ref_pipeline(s, ALL_TRUNCATIONS, order))


def test_orders_give_different_results() -> None:
    """The orders above are not interchangeable: NumPy predicts different kept sets and the sampler follows."""
    s = random_logits(301)
    kept = {}
    for order in ORDERS:
        got = make_sampler(dict(ALL_TRUNCATIONS, sampler_order=order)).warp(torch.tensor(s, dtype=torch.float32))
        kept[order] = tuple(np.flatnonzero(np.isfinite(got.numpy())))
        assert kept[order] == tuple(np.flatnonzero(np.isfinite(ref_pipeline(s, ALL_TRUNCATIONS, order))))
    assert kept[(5, 0, 2)] != kept[(0, 2, 5)]
    assert kept[(4, 3, 5)] != kept[(3, 4, 5)]
    assert len(set(kept.values())) >= 4


@COMPACT
def test_random_orders_and_settings(compact: bool) -> None:
    rng = np.random.default_rng(5)
    for trial in range(12):
        order = tuple(int(i) for i in rng.permutation(7)[: rng.integers(1, 8)])
        cfg = {
            "top_k": int(rng.choice([0, 5, 60])), "top_a": float(rng.choice([0.0, 0.02, 0.3])),
            "top_p": float(rng.choice([1.0, 0.5, 0.95])), "min_p": float(rng.choice([0.0, 0.05])),
            "tfs": float(rng.choice([1.0, 0.9])), "typical": float(rng.choice([1.0, 0.7])),
            "temperature": float(rng.choice([1.0, 0.7, 1.4])),
            "dynatemp_range": float(rng.choice([0.0, 0.4])),
        }
        sampler = make_sampler(dict(cfg, sampler_order=order), compact=compact)
        s = random_logits(400 + trial)
        assert_same_logits(sampler.warp(torch.tensor(s, dtype=torch.float32)), ref_pipeline(s, cfg, order))


# ----------------------------------------------------------------------------- greedy, draw, seeds


@COMPACT
@pytest.mark.parametrize("order", [(6, 0, 1, 3, 4, 2, 5), (4, 5, 0), (0, 1, 2, 3, 6)])
def test_greedy_picks_the_argmax_after_the_samplers_before_temperature(order, compact: bool) -> None:
    cfg = {"temperature": 0.0, "top_k": 50, "typical": 0.3, "tfs": 0.9}
    sampler = make_sampler(dict(cfg, sampler_order=order), compact=compact)
    for draw in range(5):
        s = random_logits(500 + draw)
        want = int(np.argmax(ref_pipeline(s, dict(cfg, temperature=1.0), [i for i in order if i != 5]
                                          if 5 not in order else order[: order.index(5)])))
        assert sampler.sample(torch.tensor(s, dtype=torch.float32)) == want


@COMPACT
def test_draw_follows_the_distribution(compact: bool) -> None:
    logits = np.array([2.0, 1.0, 0.0, -1.0, 0.5, NEG, 1.5, -3.0])
    p = softmax(logits)
    sampler = make_sampler({}, vocab=logits.size, compact=compact, seed=11)
    n = 6000
    counts = np.bincount([sampler.sample(torch.tensor(logits, dtype=torch.float32)) for _ in range(n)],
                         minlength=logits.size)
    assert counts[5] == 0
    sigma = np.sqrt(n * p * (1 - p))
    assert np.all(np.abs(counts - n * p) <= 5 * sigma + 1), (counts, n * p)


EVERYTHING = {
    "temperature": 0.9, "top_k": 80, "top_p": 0.95, "top_a": 0.01, "tfs": 0.97, "typical": 0.95, "min_p": 0.02,
    "rep_pen": 1.2, "rep_pen_range": 32, "rep_pen_slope": 0.5, "presence_penalty": 0.2,
    "dynatemp_range": 0.3, "smoothing_factor": 0.05, "dry_multiplier": 0.8, "xtc_probability": 0.5,
    "xtc_threshold": 0.05, "logit_bias": {3: 2.0}, "banned_token_ids": (4,),
}


def run_tokens(sampler: Sampler, steps: int, seed: int, vocab: int = V) -> List[int]:
    rng = np.random.default_rng(seed)
    sampler.begin([1, 2, 3, 1, 2, 3])
    out = []
    for _ in range(steps):
        token = sampler.sample(torch.tensor(rng.normal(size=vocab) * 2, dtype=torch.float32))
        sampler.accept(token)
        out.append(token)
    return out


@pytest.mark.parametrize("cfg", [EVERYTHING, dict(EVERYTHING, mirostat=2), {}], ids=["all", "mirostat", "default"])
def test_seed_makes_sampling_reproducible(cfg: Dict[str, object]) -> None:
    texts = [f"w{i}" for i in range(V)]
    first = run_tokens(make_sampler(cfg, seed=42, token_texts=texts), 40, seed=9)
    again = run_tokens(make_sampler(cfg, seed=42, token_texts=texts), 40, seed=9)
    other = run_tokens(make_sampler(cfg, seed=43, token_texts=texts), 40, seed=9)
    assert first == again
    assert first != other
    assert 4 not in first
    # Both candidate paths consume the random stream the same way and agree on the ids.
    assert run_tokens(make_sampler(cfg, seed=42, compact=False, token_texts=texts), 40, seed=9) == first


def test_seed_none_draws_a_reportable_seed() -> None:
    a = Sampler(SamplerSettings(), 16)
    b = Sampler(SamplerSettings(), 16, seed=a.seed)
    s = torch.randn(16)
    assert [a.sample(s) for _ in range(20)] == [b.sample(s) for _ in range(20)]
    assert Sampler(SamplerSettings(), 16, seed=-1).seed >= 0
    big = Sampler(SamplerSettings(), 16, seed=2**64 + 5)
    five = Sampler(SamplerSettings(), 16, seed=5)
    assert big.seed == 5
    assert [big.sample(s) for _ in range(20)] == [five.sample(s) for _ in range(20)]


# ----------------------------------------------------------------------------- XTC


@COMPACT
def test_xtc_probability_one(compact: bool) -> None:
    cfg = {"temperature": 0.5, "xtc_probability": 1.0, "xtc_threshold": 0.05}
    sampler = make_sampler(cfg, compact=compact)
    applied = 0
    for draw in range(6):
        s = random_logits(600 + draw)
        want = ref_pipeline(s, cfg, (6, 0, 1, 3, 4, 2, 5))
        assert_same_logits(sampler.warp(torch.tensor(s, dtype=torch.float32)), want)
        applied += int(np.any(want < ref_temperature(s, 0.5, 0.0) - 900))
    assert applied >= 3


@COMPACT
def test_xtc_probability_zero_and_high_threshold_are_off(compact: bool) -> None:
    s = random_logits(610)
    plain = ref_temperature(s, 0.5, 0.0)
    for cfg in ({"xtc_probability": 0.0, "xtc_threshold": 0.05}, {"xtc_probability": 1.0, "xtc_threshold": 0.6}):
        sampler = make_sampler(dict(cfg, temperature=0.5), compact=compact)
        assert_same_logits(sampler.warp(torch.tensor(s, dtype=torch.float32)), plain)


def test_xtc_rolls_once_per_token() -> None:
    """With probability 0.5 the generator advances by exactly one number per token, and about half fire."""
    s = random_logits(620)
    sampler = make_sampler({"temperature": 0.5, "xtc_probability": 0.5, "xtc_threshold": 0.05}, seed=3)
    reference = torch.Generator().manual_seed(3)
    fired = 0
    for _ in range(200):
        got = sampler.warp(torch.tensor(s, dtype=torch.float32)).numpy()
        roll = float(torch.rand(1, generator=reference))
        expect_fire = roll < 0.5
        fired += expect_fire
        assert bool(np.any(got < ref_temperature(s, 0.5, 0.0) - 900)) == expect_fire
    assert torch.equal(sampler.generator.get_state(), reference.get_state())
    assert 70 <= fired <= 130


# ----------------------------------------------------------------------------- mirostat


def ref_mirostat_v2(s: np.ndarray, mu: float) -> np.ndarray:
    p = softmax(s)
    remove = -np.log2(np.where(p > 0, p, 1e-300)) > mu
    remove[np.argmax(s)] = False
    return np.where(remove, NEG, s)


def ref_mirostat_v1_k(s: np.ndarray, mu: float, vocab: int) -> float:
    p = np.sort(softmax(s))[::-1]
    m = min(100, p.size)
    i = np.arange(m - 1)
    t = np.log((i + 2) / (i + 1))
    b = np.log(p[: m - 1] / p[1:m])
    s_hat = np.sum(t * b) / np.sum(t * t)
    eps = s_hat - 1
    return ((eps * 2 ** mu) / (1 - vocab ** (-eps))) ** (1 / s_hat)


@COMPACT
@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_truncation_and_mu_update(version: int, compact: bool) -> None:
    tau, eta, temp = 3.0, 0.2, 0.9
    sampler = make_sampler({"mirostat": version, "mirostat_tau": tau, "mirostat_eta": eta, "temperature": temp,
                            "top_k": 3}, compact=compact, seed=5)
    sampler.begin([1, 2])
    assert sampler.mirostat_mu == pytest.approx(2 * tau)
    mus = []
    for step in range(12):
        s = random_logits(700 + step)
        mu = sampler.mirostat_mu
        scaled = s / temp
        if version == 2:
            want = ref_mirostat_v2(scaled, mu)
        else:
            k = ref_mirostat_v1_k(scaled, mu, V)
            if abs(k - round(k)) < 1e-3:
                continue
            k = int(min(max(math.floor(k), 1), V))
            order = np.argsort(-scaled, kind="stable")
            want = np.full_like(scaled, NEG)
            want[order[:k]] = scaled[order[:k]]
        assert_same_logits(sampler.warp(torch.tensor(s, dtype=torch.float32)), want)
        token = sampler.sample(torch.tensor(s, dtype=torch.float32))
        p = softmax(want)
        assert p[token] > 0
        expected_mu = mu - eta * (-math.log2(p[token]) - tau)
        assert sampler.mirostat_mu == pytest.approx(expected_mu, rel=1e-4, abs=1e-4)
        mus.append(sampler.mirostat_mu)
        sampler.accept(token)
    assert len(set(mus)) > 3
    sampler.begin([1])
    assert sampler.mirostat_mu == pytest.approx(2 * tau)


# ----------------------------------------------------------------------------- edge cases

EDGE_CONFIGS = [
    {},
    {"temperature": 0.0},
    dict(EVERYTHING),
    dict(EVERYTHING, rep_pen_mode="koboldcpp", frequency_penalty=0.3),
    {"mirostat": 1},
    {"mirostat": 2, "temperature": 0.0},
    {"xtc_probability": 1.0, "xtc_threshold": 0.0},
    {"tfs": 0.1, "typical": 0.1, "top_p": 0.0, "min_p": 1.0, "top_a": 100.0},
    {"dry_multiplier": 2.0, "dry_allowed_length": 0, "rep_pen": 3.0},
]


@COMPACT
@pytest.mark.parametrize("cfg", EDGE_CONFIGS, ids=range(len(EDGE_CONFIGS)))
def test_single_token_vocabulary(cfg: Dict[str, object], compact: bool) -> None:
    sampler = make_sampler({k: v for k, v in cfg.items() if k not in ("logit_bias", "banned_token_ids")},
                           vocab=1, compact=compact, token_texts=["x"])
    sampler.begin([0, 0, 0])
    for _ in range(3):
        assert sampler.sample(torch.tensor([0.3])) == 0
        assert torch.isfinite(sampler.warp(torch.tensor([0.3]))).all()
        sampler.accept(0)


@COMPACT
@pytest.mark.parametrize("cfg", EDGE_CONFIGS, ids=range(len(EDGE_CONFIGS)))
def test_only_one_finite_logit(cfg: Dict[str, object], compact: bool) -> None:
    sampler = make_sampler(cfg, compact=compact, token_texts=[f"w{i}" for i in range(V)])
    sampler.begin([7, 8, 7, 8, 7])
    for j in (7, 500, 999):
        s = torch.full((V,), float("-inf"))
        s[j] = -2.0
        assert sampler.sample(s) == j
        sampler.accept(j)


@COMPACT
def test_every_token_banned_falls_back_to_the_raw_logits(compact: bool) -> None:
    s = random_logits(800, vocab=50)
    sampler = make_sampler({"banned_token_ids": tuple(range(50)), "top_k": 1}, vocab=50, compact=compact)
    assert sampler.sample(torch.tensor(s, dtype=torch.float32)) == int(np.argmax(s))
    partly = make_sampler({"banned_token_ids": tuple(range(49)), "top_k": 1}, vocab=50, compact=compact)
    assert partly.sample(torch.tensor(s, dtype=torch.float32)) == 49


@COMPACT
def test_very_small_and_extreme_values(compact: bool) -> None:
    s = random_logits(810)
    top = int(np.argmax(s))
    for cfg in ({"top_p": 1e-9}, {"top_p": 0.0}, {"min_p": 1.0}, {"top_a": 1e6}, {"top_k": 1}):
        got = make_sampler(dict(cfg, sampler_order=(slot_of(cfg),)), compact=compact).warp(
            torch.tensor(s, dtype=torch.float32))
        assert np.flatnonzero(np.isfinite(got.numpy())).tolist() == [top]
    got = make_sampler({"typical": 1e-9, "sampler_order": (4,)}, compact=compact).warp(
        torch.tensor(s, dtype=torch.float32))
    assert_same_logits(got, ref_typical(s, 1e-9))
    assert np.isfinite(got.numpy()).sum() == 1


TIE_SAMPLERS = [
    ({"top_k": 10}, lambda s: ref_top_k(s, 10), True),
    ({"top_a": 0.2}, lambda s: ref_top_a(s, 0.2), True),
    ({"min_p": 0.3}, lambda s: ref_min_p(s, 0.3), True),
    ({"top_p": 0.6}, lambda s: ref_top_p(s, 0.6), False),
    ({"tfs": 0.8}, lambda s: ref_tfs(s, 0.8), False),
    ({"typical": 0.6}, lambda s: ref_typical(s, 0.6), False),
]


@COMPACT
@pytest.mark.parametrize("cfg,ref,exact", TIE_SAMPLERS, ids=[str(c) for c, _, _ in TIE_SAMPLERS])
def test_ties(cfg: Dict[str, object], ref, exact: bool, compact: bool) -> None:
    """Integer logits tie a lot: threshold samplers keep every tied token; order-based ones the right count."""
    sampler = make_sampler(dict(cfg, sampler_order=(slot_of(cfg),)), vocab=200, compact=compact)
    for draw in range(4):
        s = np.random.default_rng(900 + draw).integers(-4, 3, size=200).astype(np.float64)
        got = sampler.warp(torch.tensor(s, dtype=torch.float32))
        if exact:
            assert_same_logits(got, ref(s))
        else:
            assert_same_kept_values(got, ref(s))


# ----------------------------------------------------------------------------- bias, validation, helpers


def test_logit_bias_is_clamped_and_bans_are_absolute() -> None:
    s = random_logits(1000, vocab=20)
    sampler = make_sampler({"logit_bias": {2: 500.0, 3: -7.5, 99: 5.0, -1: 5.0}, "banned_token_ids": (5, 6, 77)},
                           vocab=20)
    want = s.copy()
    want[2] += 100.0
    want[3] -= 7.5
    want[[5, 6]] = NEG
    assert_same_logits(sampler.warp(torch.tensor(s, dtype=torch.float32)), want)
    assert all(sampler.sample(torch.tensor(s, dtype=torch.float32)) == 2 for _ in range(5))


BAD_VALUES = [
    ("top_p", 1.5), ("top_p", -0.1), ("tfs", 2.0), ("typical", -1.0), ("min_p", 1.1), ("top_a", -0.5),
    ("rep_pen", 0.0), ("rep_pen_range", -1), ("rep_pen_slope", -1.0), ("rep_pen_mode", "koboldai"),
    ("temperature", float("nan")), ("presence_penalty", float("inf")), ("mirostat", 3),
    ("mirostat_tau", -1.0), ("dynatemp_range", -0.1), ("smoothing_factor", -1.0),
    ("dry_multiplier", -1.0), ("dry_allowed_length", -1), ("xtc_probability", 1.5), ("xtc_threshold", -0.1),
    ("sampler_order", (0, 7)), ("sampler_order", (0, 0)), ("dry_sequence_breakers", ("a", 3)),
    ("logit_bias", {1: float("nan")}), ("banned_token_ids", ("x",)), ("top_k", 2.5),
]


@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[f"{n}={v}" for n, v in BAD_VALUES])
def test_validate_names_the_bad_field(name: str, value: object) -> None:
    settings = SamplerSettings(**{name: value})
    with pytest.raises(RequestError) as info:
        settings.validate()
    assert info.value.field == name
    with pytest.raises(RequestError):
        Sampler(settings, 10)


def test_validate_accepts_defaults_and_edges() -> None:
    SamplerSettings().validate()
    SamplerSettings(top_p=0.0, top_k=-1, tfs=0.0, min_p=1.0, temperature=-1.0, sampler_order=(),
                    rep_pen_mode="koboldcpp", xtc_threshold=1.0, presence_penalty=-2.0).validate()


def test_parse_sequence_breakers() -> None:
    assert parse_sequence_breakers(["\n", ":"]) == ("\n", ":")
    assert parse_sequence_breakers('["\\n", ":", "\\"", "*"]') == ("\n", ":", '"', "*")
    assert parse_sequence_breakers('"###"') == ("###",)
    assert parse_sequence_breakers(None) == ()
    assert len(parse_sequence_breakers([str(i) for i in range(40)])) == 24
    for bad in ("[unclosed", "[1, 2]", 5):
        with pytest.raises(RequestError) as info:
            parse_sequence_breakers(bad)  # type: ignore[arg-type]
        assert info.value.field == "dry_sequence_breakers"


def test_benchmark_samplers_reports_every_case() -> None:
    result = benchmark_samplers(512, "cpu", steps=3, context_len=200)
    for key in ("default_ms", "greedy_ms", "lite_defaults_ms", "all_united_ms", "all_koboldcpp_ms", "mirostat2_ms"):
        assert isinstance(result[key], float) and 0.0 < result[key] < 10_000.0
    assert result["vocab_size"] == 512


def test_orders_cover_every_permutation_of_a_pair() -> None:
    """Every ordered pair of the order-sensitive samplers matches NumPy (host path)."""
    cfg = {"top_k": 30, "top_a": 0.05, "top_p": 0.7, "tfs": 0.9, "typical": 0.8, "temperature": 0.5}
    s = random_logits(1100)
    for pair in itertools.permutations(range(6), 2):
        got = make_sampler(dict(cfg, sampler_order=pair)).warp(torch.tensor(s, dtype=torch.float32))
        assert_same_logits(got, ref_pipeline(s, cfg, pair))
