"""Repetition penalties (United curve, KoboldCpp half-window), presence/frequency and DRY vs NumPy oracles.

The oracles recompute everything from the whole context on every step (no incremental state), so the
sampler's per-token device state is checked through begin / accept / rewind sequences.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest
import torch

from kobold_backend.engine.sampling import Sampler, SamplerSettings

NEG = -np.inf
V = 60


# ----------------------------------------------------------------------------- NumPy oracles


def ref_rep_pen_united(s: np.ndarray, ctx: Sequence[int], pen: float, rng: int, slope: float) -> np.ndarray:
    """United's RepetitionPenalty.torch: last min(len, range) ids (all if range 0), curve aligned to the newest.

    Each position penalises the original score; where an id repeats, the newest position's value is the
    one that lands (positions are written oldest to newest).
    """
    out = s.copy()
    if pen == 1.0:
        return out
    ids = list(ctx)
    if rng > 0:
        ids = ids[len(ids) - min(len(ids), rng):]
    if rng > 0 and slope != 0:
        if rng == 1:
            curve = np.array([pen])
        else:
            x = np.arange(rng) / (rng - 1) * 2.0 - 1.0
            y = slope * x / (1.0 + np.abs(x) * (slope - 1.0))
            curve = 1.0 + (y + 1.0) / 2.0 * (pen - 1.0)
        pens = curve[rng - len(ids):]
    else:
        pens = np.full(len(ids), pen)
    for token, p in zip(ids, pens):
        v = s[token]
        out[token] = v * p if v <= 0 else v / p
    return out


def ref_rep_pen_kcpp(s: np.ndarray, ctx: Sequence[int], pen: float, rng: int, slope: float,
                     presence: float) -> np.ndarray:
    """KoboldCpp's sample_rep_pen: window min(len, max(range, 1)); i*2 >= n is the near half."""
    n = min(len(ctx), max(rng, 1))
    last = list(ctx)[len(ctx) - n:]
    near = {last[i] for i in range(n) if 2 * i >= n}
    far = {last[i] for i in range(n) if 2 * i < n}
    reduced = 1.0 + (pen - 1.0) * slope if pen > 1.0 else pen
    out = s.copy()
    for token in near | far:
        p = pen if token in near else reduced
        out[token] = out[token] * p if out[token] <= 0 else out[token] / p
        out[token] -= presence
    return out


def window_ids(ctx: Sequence[int], rng: int, mode: str) -> List[int]:
    n = len(ctx) if (mode == "kobold_united" and rng == 0) else min(len(ctx), max(rng, 1))
    return list(ctx)[len(ctx) - n:]


def ref_penalties(s: np.ndarray, ctx: Sequence[int], cfg: Dict[str, float]) -> np.ndarray:
    mode = cfg.get("rep_pen_mode", "kobold_united")
    pen, rng, slope = cfg.get("rep_pen", 1.0), cfg.get("rep_pen_range", 0), cfg.get("rep_pen_slope", 1.0)
    presence, frequency = cfg.get("presence_penalty", 0.0), cfg.get("frequency_penalty", 0.0)
    if mode == "koboldcpp":
        out = ref_rep_pen_kcpp(s, ctx, pen, rng, slope, presence)
    else:
        out = ref_rep_pen_united(s, ctx, pen, rng, slope)
        for token in set(window_ids(ctx, rng, mode)):
            out[token] -= presence
    for token in window_ids(ctx, rng, mode):
        out[token] -= frequency
    return out


def breaker_ends(ctx: Sequence[int], texts: Sequence[str], breakers: Sequence[str]) -> List[bool]:
    """Per position: does an occurrence of a breaker in the joined text end inside this token's text?"""
    spans, pos = [], 0
    for token in ctx:
        spans.append((pos, pos + len(texts[token])))
        pos += len(texts[token])
    text = "".join(texts[t] for t in ctx)
    ends = [False] * len(ctx)
    for b in breakers:
        if not b:
            continue
        start = text.find(b)
        while start != -1:
            last_char = start + len(b) - 1
            for i, (lo, hi) in enumerate(spans):
                if lo <= last_char < hi:
                    ends[i] = True
            start = text.find(b, start + 1)
    return ends


def ref_dry(s: np.ndarray, ctx: Sequence[int], texts: Optional[Sequence[str]], mult: float, base: float,
            allowed: int, last_n: int, breakers: Sequence[str]) -> np.ndarray:
    """Spec C DRY by brute force: for every window position, the longest match of the context's suffix
    ending there (capped by the window start and by the tokens after the last breaker)."""
    out = s.copy()
    n_ctx = len(ctx)
    w = n_ctx if last_n <= 0 else min(n_ctx, last_n)
    if mult <= 0 or base <= 0 or w <= allowed or w < 2:
        return out
    win = list(ctx)[n_ctx - w:]
    rep_limit = w
    if texts is not None:
        ends = breaker_ends(ctx, texts, breakers)
        inside = [i for i in range(n_ctx - w, n_ctx) if ends[i]]
        if inside:
            rep_limit = n_ctx - 1 - inside[-1]
    if rep_limit <= allowed:
        return out
    best: Dict[int, int] = {}
    for j in range(w - 1):
        n = 0
        while n <= j and win[j - n] == win[w - 1 - n]:
            n += 1
        n = min(n, rep_limit)
        if n >= allowed:
            best[win[j + 1]] = max(best.get(win[j + 1], -1), n)
    max_exp = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    for token, n in best.items():
        e = n - allowed
        if max_exp > 0:
            e = min(e, max_exp)
        out[token] -= mult * base ** e
    return out


# ----------------------------------------------------------------------------- helpers


def make(cfg: Dict[str, object], compact: bool, vocab: int = V, texts: Optional[List[str]] = None) -> Sampler:
    sampler = Sampler(SamplerSettings(**cfg), vocab, "cpu", seed=1, token_texts=texts)
    sampler.compact = compact
    return sampler


def assert_close(got: torch.Tensor, want: np.ndarray) -> None:
    got_np = got.double().numpy()
    np.testing.assert_array_equal(np.isfinite(got_np), np.isfinite(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got_np[finite], want[finite], rtol=1e-5, atol=1e-4)


def repetitive_context(seed: int, length: int, vocab: int = V) -> List[int]:
    """Phrases from a small pool, repeated with noise: plenty of repeats of every length."""
    rng = np.random.default_rng(seed)
    phrases = [list(rng.integers(0, vocab, size=rng.integers(2, 7))) for _ in range(5)]
    out: List[int] = []
    while len(out) < length:
        out.extend(phrases[rng.integers(0, 5)] if rng.random() < 0.8 else [int(rng.integers(0, vocab))])
    return [int(t) for t in out[:length]]


def logits_for(step: int, vocab: int = V) -> np.ndarray:
    return np.random.default_rng(10_000 + step).normal(size=vocab) * 3.0


def check_sequence(sampler: Sampler, ctx: List[int], ref, steps_accept: int = 12, rewind: int = 5) -> None:
    """begin(prefix) then accept one token at a time, rewind, accept again; compare warp after each step."""
    split = len(ctx) - steps_accept
    sampler.begin(ctx[:split])
    current = ctx[:split]
    step = 0

    def compare() -> None:
        s = logits_for(step)
        assert_close(sampler.warp(torch.tensor(s, dtype=torch.float32)), ref(s, current))

    compare()
    for token in ctx[split:]:
        sampler.accept(token)
        current = current + [token]
        step += 1
        compare()
    sampler.rewind(rewind)
    current = current[:-rewind]
    step += 1
    compare()
    for token in ctx[split - 3: split + 3]:
        sampler.accept(token)
        current = current + [token]
        step += 1
        compare()


COMPACT = pytest.mark.parametrize("compact", [True, False], ids=["host", "fixed"])


# ----------------------------------------------------------------------------- repetition penalty


@COMPACT
@pytest.mark.parametrize("rng", [0, 1, 2, 7, 64])
@pytest.mark.parametrize("slope", [0.0, 0.3, 1.0, 2.5])
@pytest.mark.parametrize("pen", [1.3, 0.8])
def test_united_curve_matches_numpy(rng: int, slope: float, pen: float, compact: bool) -> None:
    cfg = {"rep_pen": pen, "rep_pen_range": rng, "rep_pen_slope": slope, "sampler_order": (6,)}
    sampler = make(cfg, compact)
    ctx = repetitive_context(rng * 7 + int(slope * 10), 40)
    check_sequence(sampler, ctx, lambda s, c: ref_rep_pen_united(s, c, pen, rng, slope))


def test_united_curve_shape() -> None:
    """Newest token gets the full penalty, the oldest of a full window about 1 (slope 1: linear)."""
    pen, rng = 2.0, 5
    ctx = [10, 11, 12, 13, 14]
    s = np.full(V, 4.0)
    got = make({"rep_pen": pen, "rep_pen_range": rng, "rep_pen_slope": 1.0, "sampler_order": (6,)}, True)
    got.begin(ctx)
    out = got.warp(torch.tensor(s, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(4.0 / out[ctx], [1.0, 1.25, 1.5, 1.75, 2.0], rtol=1e-6)


@COMPACT
@pytest.mark.parametrize("rng", [0, 1, 5, 6, 64])
@pytest.mark.parametrize("slope", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("pen,presence", [(1.25, 0.0), (1.0, 0.7), (1.25, 0.7), (0.9, 0.3)])
def test_koboldcpp_half_window_matches_numpy(rng: int, slope: float, pen: float, presence: float,
                                             compact: bool) -> None:
    cfg = {"rep_pen": pen, "rep_pen_range": rng, "rep_pen_slope": slope, "presence_penalty": presence,
           "rep_pen_mode": "koboldcpp", "sampler_order": (6,)}
    sampler = make(cfg, compact)
    ctx = repetitive_context(rng * 3 + int(slope * 10), 40)
    check_sequence(sampler, ctx, lambda s, c: ref_rep_pen_kcpp(s, c, pen, rng, slope, presence))


@pytest.mark.parametrize("mode", ["kobold_united", "koboldcpp"])
@pytest.mark.parametrize("rng", [1_000_000, 5000])
def test_huge_ranges_cost_only_the_window(mode: str, rng: int) -> None:
    """The curve / half-window factors are built for the window seen so far, growing past 1024 tokens."""
    cfg = {"rep_pen": 1.3, "rep_pen_range": rng, "rep_pen_slope": 0.5, "rep_pen_mode": mode,
           "sampler_order": (6,)}
    for order in ((6,), (2, 6)):
        sampler = make(dict(cfg, sampler_order=order, top_p=0.999999), True)
        ctx = repetitive_context(rng % 97, 1500)
        sampler.begin(ctx[:1000])
        for token in ctx[1000:]:
            sampler.accept(token)
        s = logits_for(4)
        penalised = (ref_rep_pen_united(s, ctx, 1.3, rng, 0.5) if mode == "kobold_united"
                     else ref_rep_pen_kcpp(s, ctx, 1.3, rng, 0.5, 0.0))
        want = penalised if order == (6,) else ref_penalties_after_top_p(s, ctx, cfg)
        assert_close(sampler.warp(torch.tensor(s, dtype=torch.float32)), want)


def ref_penalties_after_top_p(s: np.ndarray, ctx: Sequence[int], cfg: Dict[str, float]) -> np.ndarray:
    return ref_penalties(ref_top_p(s, 0.999999), ctx, cfg)


def test_koboldcpp_half_window_by_hand() -> None:
    """Window of 4: [a b | c d]: c, d (newer half) get 2.0; a, b only the reduced 1 + (2-1)*0.5 = 1.5."""
    cfg = {"rep_pen": 2.0, "rep_pen_range": 4, "rep_pen_slope": 0.5, "rep_pen_mode": "koboldcpp",
           "sampler_order": (6,)}
    sampler = make(cfg, True)
    sampler.begin([9, 1, 2, 3, 4])
    s = np.full(V, 6.0)
    s[2] = -6.0
    out = sampler.warp(torch.tensor(s, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(out[[1, 2, 3, 4, 9]], [4.0, -9.0, 3.0, 3.0, 6.0])


@COMPACT
@pytest.mark.parametrize("mode", ["kobold_united", "koboldcpp"])
@pytest.mark.parametrize("rng", [0, 6, 64])
def test_presence_and_frequency(mode: str, rng: int, compact: bool) -> None:
    cfg = {"rep_pen": 1.15, "rep_pen_range": rng, "rep_pen_slope": 0.7, "presence_penalty": 0.4,
           "frequency_penalty": 0.25, "rep_pen_mode": mode, "sampler_order": (6,)}
    sampler = make(cfg, compact)
    ctx = repetitive_context(rng + 100, 45)
    check_sequence(sampler, ctx, lambda s, c: ref_penalties(s, c, cfg), steps_accept=15, rewind=7)


@COMPACT
def test_penalty_position_in_the_order(compact: bool) -> None:
    """Slot 6 after temperature penalises the scaled logits; before it, the raw ones."""
    cfg = {"rep_pen": 1.5, "rep_pen_range": 8, "temperature": 0.5}
    ctx = [1, 2, 3, 1, 5]
    s = logits_for(0)
    first = make(dict(cfg, sampler_order=(6, 5)), compact)
    first.begin(ctx)
    assert_close(first.warp(torch.tensor(s, dtype=torch.float32)),
                 ref_rep_pen_united(s, ctx, 1.5, 8, 1.0) / 0.5)
    last = make(dict(cfg, sampler_order=(5, 6)), compact)
    last.begin(ctx)
    assert_close(last.warp(torch.tensor(s, dtype=torch.float32)), ref_rep_pen_united(s / 0.5, ctx, 1.5, 8, 1.0))


def ref_top_p(s: np.ndarray, top_p: float) -> np.ndarray:
    """United top-p (ascending sort, remove cumulative <= 1 - top_p)."""
    finite = np.isfinite(s)
    p = np.zeros_like(s)
    p[finite] = np.exp(s[finite] - s[finite].max())
    p /= p.sum()
    order = np.argsort(s, kind="stable")
    remove = np.zeros(s.size, dtype=bool)
    remove[order] = np.cumsum(p[order]) <= 1.0 - top_p
    return np.where(remove, NEG, s)


@COMPACT
@pytest.mark.parametrize("mode", ["kobold_united", "koboldcpp"])
@pytest.mark.parametrize("order", [(2, 6), (6, 2)])
def test_penalties_on_a_sorted_candidate_set(mode: str, order: Sequence[int], compact: bool) -> None:
    """After top-p the candidates are sorted (and compacted on the host): the per-token state is gathered."""
    cfg = {"rep_pen": 1.3, "rep_pen_range": 9, "rep_pen_slope": 0.6, "presence_penalty": 0.3,
           "frequency_penalty": 0.2, "rep_pen_mode": mode, "top_p": 0.9, "sampler_order": order}
    sampler = make(cfg, compact)
    ctx = repetitive_context(11, 40)
    if order == (2, 6):
        ref = lambda s, c: ref_penalties(ref_top_p(s, 0.9), c, cfg)  # noqa: E731
    else:
        ref = lambda s, c: ref_top_p(ref_penalties(s, c, cfg), 0.9)  # noqa: E731
    check_sequence(sampler, ctx, ref)


def test_tokens_outside_the_vocabulary_are_ignored() -> None:
    cfg = {"rep_pen": 1.5, "rep_pen_range": 0, "presence_penalty": 0.5, "frequency_penalty": 0.5,
           "dry_multiplier": 1.0, "dry_allowed_length": 1, "sampler_order": (6,)}
    sampler = make(cfg, True)
    sampler.begin([3, 999, -5, 3, 999])
    sampler.accept(12345)
    s = logits_for(1)
    in_vocab = [3, 3]
    want = ref_penalties(s, in_vocab, cfg)
    got = sampler.warp(torch.tensor(s, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(got[[3, 4, 5]], want[[3, 4, 5]], rtol=1e-5)


# ----------------------------------------------------------------------------- DRY

TEXTS = [("\n" if i % 11 == 0 else ":x" if i % 13 == 0 else f"w{i}") for i in range(V)]


def test_dry_by_hand() -> None:
    """a b c d a b c: emitting d would extend the repeat 'a b c' (length 3) -> 0.8 * 1.75^(3-2)."""
    s = np.zeros(V)
    sampler = make({"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2}, True, texts=TEXTS)
    sampler.begin([1, 2, 3, 4, 1, 2, 3])
    out = sampler.warp(torch.tensor(s, dtype=torch.float32)).numpy()
    want = np.zeros(V)
    want[4] = -1.4
    np.testing.assert_allclose(out, want, atol=1e-6)


def test_dry_breaker_caps_the_repeat() -> None:
    """1 \\n 2 3 4 \\n 2 3: the match '\\n 2 3' (3 long) is capped to the 2 tokens after the last breaker."""
    nl = 22
    assert TEXTS[nl] == "\n"
    ctx = [1, nl, 2, 3, 4, nl, 2, 3]
    cfg = {"dry_multiplier": 1.0, "dry_base": 2.0, "dry_allowed_length": 1}
    for breakers, penalty in ((("\n", ":"), 2.0), ((), 4.0)):
        sampler = make(dict(cfg, dry_sequence_breakers=breakers), True, texts=TEXTS)
        sampler.begin(ctx)
        want = np.zeros(V)
        want[4] = -penalty
        np.testing.assert_allclose(sampler.warp(torch.zeros(V)).numpy(), want, atol=1e-6)
    # KoboldCpp stops when the breaker leaves no more than allowed_length tokens to repeat.
    sampler = make(dict(cfg, dry_allowed_length=2), True, texts=TEXTS)
    sampler.begin(ctx)
    np.testing.assert_allclose(sampler.warp(torch.zeros(V)).numpy(), np.zeros(V))


def test_dry_multi_token_breaker() -> None:
    """A breaker spelled across two tokens ("a#" then "#b" spell "##") restarts like a single-token one."""
    texts = [f"t{i}" for i in range(V)]
    texts[40] = "a#"
    texts[41] = "#b"
    cfg = {"dry_multiplier": 1.0, "dry_base": 2.0, "dry_allowed_length": 1}
    ctx = [5, 40, 41, 6, 7, 8, 5, 40, 41, 6, 7]
    for breakers, penalty in ((("##",), 2.0), (("#x",), 16.0)):
        sampler = make(dict(cfg, dry_sequence_breakers=breakers), True, texts=texts)
        sampler.begin(ctx)
        out = sampler.warp(torch.zeros(V)).numpy()
        assert out[8] == pytest.approx(-penalty)
        np.testing.assert_allclose(out, ref_dry(np.zeros(V), ctx, texts, 1.0, 2.0, 1, 0, breakers), atol=1e-6)
    # The same, reached token by token.
    sampler = make(dict(cfg, dry_sequence_breakers=("##",)), True, texts=texts)
    sampler.begin(ctx[:3])
    for token in ctx[3:]:
        sampler.accept(token)
    assert sampler.warp(torch.zeros(V)).numpy()[8] == pytest.approx(-2.0)


@COMPACT
@pytest.mark.parametrize("last_n", [0, 8, 33])
@pytest.mark.parametrize("allowed", [0, 1, 2, 4])
@pytest.mark.parametrize("base,mult", [(1.75, 0.8), (1.0, 1.5), (0.5, 2.0)])
def test_dry_matches_brute_force(last_n: int, allowed: int, base: float, mult: float, compact: bool) -> None:
    breakers = ("\n", ":", '"', "*")
    cfg = {"dry_multiplier": mult, "dry_base": base, "dry_allowed_length": allowed, "dry_penalty_last_n": last_n,
           "dry_sequence_breakers": breakers}
    sampler = make(cfg, compact, texts=TEXTS)
    ctx = repetitive_context(last_n * 5 + allowed, 60)
    check_sequence(sampler, ctx, lambda s, c: ref_dry(s, c, TEXTS, mult, base, allowed, last_n, breakers),
                   steps_accept=20, rewind=6)


def test_dry_exponent_is_clamped() -> None:
    """A long run with a huge base: base^(n - allowed) is capped below float overflow, as in KoboldCpp."""
    base = 1e6
    ctx = [7] * 30
    sampler = make({"dry_multiplier": 1.0, "dry_base": base, "dry_allowed_length": 2}, True, texts=TEXTS)
    sampler.begin(ctx)
    out = sampler.warp(torch.zeros(V)).numpy()
    want = ref_dry(np.zeros(V), ctx, TEXTS, 1.0, base, 2, 0, ())
    assert np.isfinite(out[7]) and out[7] == pytest.approx(want[7], rel=1e-5)
    assert want[7] == pytest.approx(-(base ** int(88.7228391 / math.log(base))), rel=1e-9)


def test_dry_without_token_texts_has_no_breakers() -> None:
    nl = 22
    ctx = [1, nl, 2, 3, 4, nl, 2, 3]
    sampler = make({"dry_multiplier": 1.0, "dry_base": 2.0, "dry_allowed_length": 2}, True, texts=None)
    sampler.begin(ctx)
    out = sampler.warp(torch.zeros(V)).numpy()
    np.testing.assert_allclose(out, ref_dry(np.zeros(V), ctx, None, 1.0, 2.0, 2, 0, ()), atol=1e-6)


@COMPACT
def test_dry_and_penalties_together_over_a_long_run(compact: bool) -> None:
    """Many accepts past the DRY buffer's first capacity (1024) with sliding windows."""
    cfg = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 50,
           "rep_pen": 1.2, "rep_pen_range": 40, "rep_pen_slope": 0.5, "frequency_penalty": 0.1,
           "sampler_order": (6,)}
    sampler = make(cfg, compact, texts=TEXTS)
    ctx = repetitive_context(77, 1300)
    sampler.begin(ctx[:1000])
    for token in ctx[1000:]:
        sampler.accept(token)
    s = logits_for(3)
    want = ref_penalties(ref_dry(s, ctx, TEXTS, 0.8, 1.75, 2, 50, ("\n", ":", '"', "*")), ctx, cfg)
    assert_close(sampler.warp(torch.tensor(s, dtype=torch.float32)), want)
