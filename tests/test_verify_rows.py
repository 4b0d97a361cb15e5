"""The speculative verification forward: k+1 rows fed at a device-tensor position in one `decode_step` (what a
CUDA graph captures) give the prompt forward's logits and cache contents; the multi-row attention equals prompt
attention (causal, sliding window, soft-capping) in float64; the speculator backs off after rejected rounds."""

from __future__ import annotations

from typing import Any, List

import pytest
import torch

from kobold_backend import ops
from kobold_backend.engine.drafters import Draft
from kobold_backend.engine.generator import GenerationRequest, Generator
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.sampling import SamplerSettings
from kobold_backend.engine.speculative import BACKOFF_AFTER, MAX_BACKOFF, SpeculationConfig
from kobold_backend.ops import reference


@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 0.7), (3, 1.5)])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2)])
def test_rows_attention_is_prompt_attention(window: Any, softcap: Any, hq: int, hkv: int) -> None:
    g = torch.Generator().manual_seed(hq * 10 + (window or 0))
    b, t, d, pos, length = 2, 5, 16, 9, 32
    q = torch.randn(b, t, hq, d, generator=g, dtype=torch.float64)
    kc = torch.randn(b, hkv, length, d, generator=g, dtype=torch.float64)
    vc = torch.randn(b, hkv, length, d, generator=g, dtype=torch.float64)
    kc[:, :, pos + t:] = float("nan")  # positions past the last row are masked out
    vc[:, :, pos + t:] = float("nan")
    got = reference.decode_attention_rows(q, kc.nan_to_num(), vc.nan_to_num(), torch.tensor([pos]), length, 0.3,
                                          window, softcap)
    want = reference.attention(q, kc, vc, pos, 0.3, window, softcap)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)  # scores are float32, as in decode_attention_at
    one = [reference.decode_attention_at(q[:, i], kc.nan_to_num(), vc.nan_to_num(), torch.tensor([pos + i]), length,
                                         0.3, window, softcap) for i in range(t)]
    torch.testing.assert_close(got, torch.stack(one, dim=1), rtol=2e-5, atol=2e-6)
    assert ops.decode_attention_rows(q[:, :1], kc, vc, torch.tensor([pos]), pos + 1, 0.3, window, softcap).shape \
        == (b, 1, hq, d)


def _forwards(lm: Any, prompt: List[int], rows: List[int], cache_dtype: Any = None) -> Any:
    """(prompt-forward logits of `rows` after `prompt`, its cache) and the same through decode_step."""
    model = lm.model
    out = []
    for multi in (False, True):
        cache = model.new_cache(64, cache_dtype=cache_dtype)
        model.forward(torch.tensor([prompt]), cache)
        x = torch.tensor([rows])
        if multi:
            logits = model.decode_step(x, torch.tensor([cache.seq_len]), cache, 48)
            cache.seq_len += len(rows)
        else:
            logits = model.forward(x, cache, last_only=False)
        out.append((logits, cache))
    return out


@pytest.mark.parametrize("name, cache_dtype, tol", [("dense_fp32", None, 2e-5), ("gqa", None, 2e-3),
                                                    ("head32", "q8", 2e-3)])
def test_decode_step_rows_equal_the_prompt_forward(checkpoints: Any, name: str, cache_dtype: Any, tol: float) -> None:
    lm = load_model(checkpoints.get(name).path, device="cpu", max_seq_len=64)
    (want, cache_a), (got, cache_b) = _forwards(lm, [1, 5, 9, 13, 2, 7, 3], [11, 4, 8, 15, 6], cache_dtype)
    assert got.shape == want.shape == (1, 5, lm.model.config.vocab_size)
    err = (got - want).abs().max() / want.abs().max()
    assert err < tol, f"{name}: multi-row decode_step differs from the prompt forward by {err:.3g}"
    assert cache_a.seq_len == cache_b.seq_len == 12
    for index in range(len(lm.model.layers)):
        ka, kb = cache_a.k[index], cache_b.k[index]
        if cache_dtype is not None:
            ka, kb = ka.dense(12), kb.dense(12)
        torch.testing.assert_close(kb[:, :, :12].float(), ka[:, :, :12].float(), rtol=tol, atol=tol)


class _WrongDrafter:
    """Always proposes a token the target never picks; records the context length at each call."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.at: List[int] = []

    def begin(self, sampler: Any, context_shift: bool) -> None:
        self.at = []

    def propose(self, context: Any, k: int) -> Draft:
        self.at.append(len(context))
        return Draft([self.token] * k, [None] * k)


def test_speculation_backs_off_after_rejected_rounds(checkpoints: Any) -> None:
    """With drafts that are never accepted, rounds follow each other directly BACKOFF_AFTER times, then after 1, 2,
    4, ... plain steps (up to MAX_BACKOFF), and the tokens stay those of plain decoding."""
    lm = load_model(checkpoints.get("dense_fp32").path, device="cpu", max_seq_len=160)
    req = dict(prompt_ids=[1, 5, 9, 13], max_new_tokens=80, settings=SamplerSettings(temperature=0), ban_eos=True)
    plain = Generator(lm.model, lm.tokenizer).generate(GenerationRequest(**req)).token_ids
    gen = Generator(lm.model, lm.tokenizer)
    gen.use_speculation(SpeculationConfig("ngram", 3))
    drafter = _WrongDrafter(next(i for i in range(lm.model.config.vocab_size) if i not in plain))
    gen.speculator.drafter = drafter  # type: ignore[union-attr]
    assert gen.generate(GenerationRequest(**req)).token_ids == plain
    stats = gen.stats.speculation
    assert stats.accepted == 0 and stats.drafted == len(drafter.at) >= 6
    gaps = [b - a for a, b in zip(drafter.at, drafter.at[1:])]
    want = [1] * (BACKOFF_AFTER - 1) + [1 + min(2 ** i, MAX_BACKOFF) for i in range(len(gaps))]
    want = want[:len(gaps)]
    assert gaps == want, f"rounds at context lengths {drafter.at}"
    # one target forward per token but the last: a round or a plain step
    assert stats.target_forwards == 79 and stats.backed_off == 79 - len(drafter.at)
