"""The speculative verification forward on CUDA (-m gpu): k+1 rows replayed from a CUDA graph equal the eager
prompt forward (logits and cache), at several positions of one capture, with float16 and quantized caches."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kobold_backend.engine.decode_graph import GraphDecoder
from kobold_backend.engine.loader import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name, cache_dtype", [("dense_fp16", None), ("gqa", None), ("head32", "q8"),
                                               ("head32", "q4"), ("gptq_v1_sym_g32", None)])
def test_graph_rows_equal_the_eager_forward(checkpoints: Any, name: str, cache_dtype: Any) -> None:
    lm = load_model(checkpoints.get(name).path, device="cuda", max_seq_len=512)
    model = lm.model
    graph_cache = model.new_cache(512, cache_dtype=cache_dtype)
    eager_cache = model.new_cache(512, cache_dtype=cache_dtype)
    graph = GraphDecoder(model, graph_cache)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, model.config.vocab_size, (1, 40), generator=g)
    for cache in (graph_cache, eager_cache):
        model.forward(prompt.cuda(), cache)
    for rows in (5, 5, 3, 1, 5):  # the same capture at later positions, and other row counts
        ids = torch.randint(3, model.config.vocab_size, (1, rows), generator=g)
        got = graph.rows(ids[0].tolist()).clone()
        want = model.forward(ids.cuda(), eager_cache, last_only=False)[0]
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 2e-2, f"{name} {cache_dtype}: {rows} rows at {graph_cache.seq_len - rows}: {err:.3g}"
        assert torch.equal(got.argmax(-1), want.argmax(-1)) or err < 5e-3
        assert graph_cache.seq_len == eager_cache.seq_len
    n = graph_cache.seq_len
    for index in range(len(model.layers)):
        a, b = graph_cache.k[index], eager_cache.k[index]
        a, b = (a.dense(n), b.dense(n)) if cache_dtype else (a[:, :, :n], b[:, :, :n])
        # a 4-bit cache may round a key one level apart when its float16 input differs in the last bit
        level = float(b.float().abs().max()) / 7 if cache_dtype == "q4" else 2e-2
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=level * 1.01)


@pytest.mark.parametrize("length", [512, 2048, 16384])
def test_graph_decode_attention_over_a_long_fp16_cache(length: int) -> None:
    """ops.decode_attention_at (what a decode graph calls) over an fp16 cache: torch's matmuls below
    NATIVE_DECODE_FROM positions, the flash-decoding kernel from there; both against float64, masked at the device
    position."""
    from kobold_backend import ops
    from kobold_backend.ops import reference

    g = torch.Generator(device="cuda").manual_seed(length)
    k = torch.randn(1, 8, length, 128, device="cuda", generator=g).half()
    v = torch.randn(1, 8, length, 128, device="cuda", generator=g).half()
    q = torch.randn(1, 32, 128, device="cuda", generator=g).half()
    pos = torch.tensor([length - 100], device="cuda")
    got = ops.decode_attention_at(q, k, v, pos, length, 128 ** -0.5)
    want = reference.decode_attention_at(q.double(), k.double(), v.double(), pos, length, 128 ** -0.5)
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err < 4e-3, f"{length}: {err:.3g} (native from {ops.NATIVE_DECODE_FROM})"
