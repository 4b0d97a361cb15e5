"""Sampler on CUDA: same logits as the CPU path, one host sync per token, seeded reproducibility (-m gpu)."""

from __future__ import annotations

import warnings
from typing import Dict

import numpy as np
import pytest
import torch

from kobold_backend.engine.sampling import Sampler, SamplerSettings, benchmark_samplers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

V = 32000
TEXTS = [("\n" if i % 97 == 0 else f"w{i}") for i in range(V)]
EVERYTHING = {
    "temperature": 0.8, "top_k": 200, "top_p": 0.95, "top_a": 0.02, "tfs": 0.97, "typical": 0.95, "min_p": 0.02,
    "rep_pen": 1.1, "rep_pen_range": 256, "rep_pen_slope": 0.7, "presence_penalty": 0.1, "frequency_penalty": 0.1,
    "dynatemp_range": 0.3, "smoothing_factor": 0.2, "dry_multiplier": 0.8, "dry_penalty_last_n": 256,
    "xtc_threshold": 0.1, "xtc_probability": 1.0, "logit_bias": {1: 2.0}, "banned_token_ids": (0,),
}
CONFIGS = [
    {},
    {"temperature": 0.0, "rep_pen": 1.3, "rep_pen_range": 64},
    EVERYTHING,
    dict(EVERYTHING, rep_pen_mode="koboldcpp", sampler_order=(6, 0, 1, 2, 3, 4, 5)),
    dict(EVERYTHING, top_k=0, sampler_order=(3, 4, 2, 5, 6)),
    {"mirostat": 1, "temperature": 0.9, "rep_pen": 1.1, "rep_pen_range": 128},
    {"mirostat": 2, "temperature": 0.9, "mirostat_tau": 3.0},
]


def context(seed: int, length: int = 600) -> list:
    rng = np.random.default_rng(seed)
    phrase = rng.integers(0, V, size=37).tolist()
    return [int(t) for t in (phrase * (length // 37 + 1))[:length]]


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_cuda_matches_the_cpu_path(cfg: Dict[str, object]) -> None:
    cpu = Sampler(SamplerSettings(**cfg), V, "cpu", seed=1, token_texts=TEXTS)
    gpu = Sampler(SamplerSettings(**cfg), V, "cuda", seed=1, token_texts=TEXTS)
    ctx = context(3)
    cpu.begin(ctx)
    gpu.begin(ctx)
    gen = torch.Generator().manual_seed(5)
    for step in range(12):
        logits = torch.randn(V, generator=gen) * 3.0
        a = cpu.warp(logits).numpy()
        b = gpu.warp(logits.cuda()).cpu().numpy()
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b))
        np.testing.assert_allclose(a[np.isfinite(a)], b[np.isfinite(b)], rtol=1e-4, atol=1e-3)
        token = gpu.sample(logits.cuda())
        assert np.isfinite(b[token])
        cpu.accept(token)
        gpu.accept(token)
        if step == 6:
            cpu.rewind(4)
            gpu.rewind(4)
        if cfg.get("mirostat"):
            cpu._mu.fill_(gpu.mirostat_mu)


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_one_host_sync_per_token(cfg: Dict[str, object]) -> None:
    sampler = Sampler(SamplerSettings(**cfg), V, "cuda", seed=1, token_texts=TEXTS)
    sampler.begin(context(4))
    logits = [torch.randn(V, device="cuda") * 3.0 for _ in range(6)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for row in logits:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                token = sampler.sample(row)
            syncs = [w for w in caught if "synchroniz" in str(w.message)]
            assert len(syncs) == 1, [str(w.message) for w in syncs]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sampler.accept(token)
            assert not [w for w in caught if "synchroniz" in str(w.message)]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_seed_is_reproducible() -> None:
    def run(seed: int) -> list:
        sampler = Sampler(SamplerSettings(**EVERYTHING), V, "cuda", seed=seed, token_texts=TEXTS)
        sampler.begin(context(5))
        gen = torch.Generator().manual_seed(9)
        out = []
        for _ in range(30):
            token = sampler.sample((torch.randn(V, generator=gen) * 2.0).cuda())
            sampler.accept(token)
            out.append(token)
        return out

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_benchmark_on_cuda() -> None:
    result = benchmark_samplers(V, "cuda", steps=5, context_len=256)
    assert 0.0 < result["all_koboldcpp_ms"] < 10_000.0
