"""Speculative decoding on CUDA with decode graphs on: greedy tokens identical to plain (graph) decoding for an
fp32 fixture and for the trained demo model (GPTQ, float16) up to float16 near-ties, with n-gram drafts and the
model drafting for itself, and seeded sampling reproducible (-m gpu)."""

from __future__ import annotations

import math
from typing import Any, List, Tuple

import pytest
import torch

from kobold_backend import demo
from kobold_backend.engine.generator import GenerationRequest, Generator
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.sampling import SamplerSettings
from kobold_backend.engine.speculative import SpeculationConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplerSettings(temperature=0)
TEXTS = [
    "Once upon a time there was a little dragon who",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "One, two, three, four, five, six,",
    "In the morning the village",
]


def _generators(lm: Any) -> List[Generator]:
    out = []
    for config in (None, SpeculationConfig("ngram", 5), SpeculationConfig("draft", 4, lm.model, "itself")):
        gen = Generator(lm.model, lm.tokenizer)
        assert gen.use_graphs, "the test is about CUDA graphs being on"
        gen.use_speculation(config)
        out.append(gen)
    return out


def _check_identical(lm: Any, prompts: List[List[int]], ulps: int = 0) -> None:
    """Greedy tokens of n-gram and self-drafting speculation equal plain decoding's. With `ulps` > 0 (float16) a
    run may part from plain decoding only where plain decoding's two best logits are within `ulps` units in the
    last place of float16 of each other: the verification forward runs k+1 rows through kernels (cuBLAS, prompt
    attention) whose rounding differs from the one-row decode step's, so an exact tie can break the other way."""
    plain, ngram, self_draft = _generators(lm)
    accepted = runs = identical = 0
    for prompt in prompts:
        for length in (1, 9, 80):
            req = dict(prompt_ids=prompt, max_new_tokens=length, settings=GREEDY, ban_eos=True)
            want = plain.generate(GenerationRequest(**req)).token_ids
            for gen in (ngram, self_draft):
                got = gen.generate(GenerationRequest(**req)).token_ids
                runs += 1
                accepted += gen.stats.speculation.accepted
                if got == want:
                    identical += 1
                    continue
                at, gap, bound = _divergence(lm, prompt, want, got, ulps)
                assert gap <= bound, f"token {at} differs ({want[at]} vs {got[at]}) where plain decoding's top-2 " \
                                     f"logit gap is {gap:.4g}, more than {ulps} float16 ulps ({bound:.4g})"
    assert accepted > 0
    assert identical >= 0.9 * runs, f"only {identical} of {runs} speculative runs equal plain decoding"


def _divergence(lm: Any, prompt: List[int], want: List[int], got: List[int], ulps: int) -> Tuple[int, float, float]:
    """Where two greedy runs part, the gap between the two best logits there (one forward over the prompt and
    plain decoding's tokens before that point), and `ulps` float16 units in the last place at the best logit's
    size."""
    at = next(i for i, (a, b) in enumerate(zip(want + [-1], got + [-2])) if a != b)
    ids = torch.tensor([prompt + want[:at]], device=lm.model.device)
    top = torch.topk(lm.model.forward(ids, lm.model.new_cache())[0, -1].float(), 2).values
    ulp = float(torch.finfo(torch.float16).eps) * 2.0 ** math.floor(math.log2(max(abs(float(top[0])), 1e-3)))
    return at, float(top[0] - top[1]), ulps * ulp


def test_greedy_identical_on_the_demo_model_with_graphs() -> None:
    lm = load_model(demo.ensure_demo_model(), device="cuda", max_seq_len=512)
    _check_identical(lm, [lm.tokenizer.encode(t, add_bos=True) for t in TEXTS], ulps=8)


def test_greedy_identical_on_an_fp32_fixture_with_graphs(checkpoints: Any) -> None:
    lm = load_model(checkpoints.get("dense_fp32").path, device="cuda", dtype="float32", max_seq_len=256)
    prompts = []
    for seed in range(4):
        ids = torch.randint(3, lm.config.vocab_size, (16,), generator=torch.Generator().manual_seed(seed)).tolist()
        prompts.append(ids + ids[:8])
    _check_identical(lm, prompts)


def test_seeded_sampling_is_reproducible_and_stays_on_the_device() -> None:
    """Two generators from the same state give the same tokens for one seed. (A second request on the same
    generator reuses the cached prompt and re-runs only its last token, through other kernels than the prompt's
    first pass, so in float16 its logits may differ in the last bits and a sampled token at a near-tie with it.)"""
    lm = load_model(demo.ensure_demo_model(), device="cuda", max_seq_len=512)
    settings = SamplerSettings(temperature=0.8, top_p=0.9, rep_pen=1.1, rep_pen_range=64)
    prompt = lm.tokenizer.encode(TEXTS[1], add_bos=True)
    runs = []
    for _ in range(2):
        gen = Generator(lm.model, lm.tokenizer)
        gen.use_speculation(SpeculationConfig("draft", 4, lm.model, "itself"))
        runs.append(gen.generate(GenerationRequest(prompt, 60, settings, seed=5, ban_eos=True)).token_ids)
        assert gen.stats.speculation.acceptance_rate > 0.5  # drafting for itself: p and q agree up to rounding
    assert runs[0] == runs[1] and len(runs[0]) == 60
