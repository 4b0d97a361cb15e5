"""Context shifting: cutting a span out of the cache, keys re-rotated, instead of re-processing the window.

The first layer's keys and values depend only on the tokens, so on a one-layer model a shifted cache must
give exactly the logits of a fresh prefill of the kept window. Deeper layers still carry what the dropped
tokens contributed when the kept ones were processed (as in KoboldCpp's context shifting).
"""

from __future__ import annotations

import torch

from kobold_backend.engine.generator import GenerationRequest, Generator
from kobold_backend.engine.lane import find_shift
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.sampling import SamplerSettings


def test_find_shift_locates_the_dropped_span() -> None:
    cached = list(range(100))
    new = list(range(10)) + list(range(40, 100)) + [7, 8]
    assert find_shift(cached, new, min_match=16) == (10, 30)
    assert find_shift(cached, list(range(50)), min_match=16) is None  # a plain prefix: nothing to drop
    assert find_shift(cached, [5, 6, 7] + list(range(40, 100)), min_match=16) is None  # no common prefix


def test_shifted_cache_gives_the_logits_of_a_fresh_prefill(checkpoints) -> None:
    lm = load_model(checkpoints.get("dense_fp32").path, device="cpu", max_seq_len=256)
    model = lm.model
    del model.layers[1:], model.cos[1:], model.sin[1:]
    vocab = lm.config.vocab_size
    ids = torch.randint(3, vocab, (1, 120), generator=torch.Generator().manual_seed(0))
    memory, dropped, kept, new = ids[:, :10], ids[:, 10:50], ids[:, 50:110], ids[:, 110:]
    cache = model.new_cache()
    model.forward(torch.cat([memory, dropped, kept], 1), cache)
    model.shift_cache(cache, 10, 40)
    assert cache.seq_len == 70
    shifted = model.forward(new, cache, last_only=False)
    fresh_cache = model.new_cache()
    fresh = model.forward(torch.cat([memory, kept, new], 1), fresh_cache, last_only=False)[:, -new.shape[1]:]
    rel = ((shifted - fresh).norm() / fresh.norm()).item()
    assert rel < 1e-5, rel


def test_generator_shifts_instead_of_reprocessing(checkpoints) -> None:
    lm = load_model(checkpoints.get("dense_fp32").path, device="cpu", max_seq_len=256)
    gen = Generator(lm.model, lm.tokenizer)
    vocab = lm.config.vocab_size
    ids = torch.randint(3, vocab, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy = SamplerSettings(temperature=0)
    gen.generate(GenerationRequest(ids, 4, greedy))
    trimmed = ids[:10] + ids[60:] + [5, 6, 7]
    shifted = gen.generate(GenerationRequest(trimmed, 8, greedy))
    assert gen.stats.reused_tokens == len(ids) - 50  # memory + kept window came from the shifted cache
    assert shifted.completion_tokens == 8 and shifted.finish_reason == "length"
    assert gen.cache.tokens == trimmed + shifted.token_ids[:-1]
    assert gen.cache.seq_len == len(gen.cache.tokens)
