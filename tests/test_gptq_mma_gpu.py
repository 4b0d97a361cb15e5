"""The tensor-core GPTQ product (csrc/cuda/gptq_mma.cu) for 9..128 rows against the float64 oracle on the CPU,
outputs poisoned: 7B shapes, group sizes 32/128/whole K, act-order, bias, split-K and one-slice shapes, rows that
fill 16-row tiles partly, large inputs, and replay inside a CUDA graph; a chat turn's chunk through a lane's
graph equals the eager forward (-m gpu)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kobold_backend.engine.lane import Lane
from kobold_backend.engine.loader import load_model
from kobold_backend.ops import native
from tests.ext_helpers import assert_close_rel, gptq_oracle, make_gptq, poisoned, random

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

F16 = torch.float16
TOL = 4e-3


@pytest.fixture(scope="module")
def kernels() -> native.CudaKernels:
    result = native.load("cuda", mode="auto")
    assert result.module is not None, f"the CUDA kernels could not be loaded or built: {result.reason}"
    return native.CudaKernels(result.module)


CASES = [
    # (K, N, group size, act-order, rows, bias)
    (4096, 4096, 128, False, 50, False),  # a chat turn's new tokens, attention projections
    (4096, 11008, 32, True, 17, True),
    (11008, 4096, 128, False, 64, False),
    (11008, 4096, 128, True, 9, True),
    (4096, 32000, -1, False, 50, False),  # the head, one group
    (4096, 4096, 128, False, 128, True),
    (256, 128, 64, False, 33, False),  # fewer K steps than the split-K would like
    (64, 64, 8, True, 100, True),  # one block, one step
]


@pytest.mark.parametrize("k,n,gs,act,m,bias", CASES)
def test_gptq_mma(kernels: native.CudaKernels, k: int, n: int, gs: int, act: bool, m: int, bias: bool) -> None:
    w = make_gptq(k, n, gs, act_order=act, dtype=F16, bias=bias, device="cuda", seed=k + m)
    x = random((m, k), F16, seed=m, device="cuda")
    y = kernels.gptq_matmul(x, w, out=poisoned((m, n), F16, "cuda"))
    want = gptq_oracle(x, w)
    assert_close_rel(y, want, TOL, f"mma {k}x{n} g{gs} act={act} m={m}")
    for i in (0, m - 1):  # first and last rows, each against its own scale
        assert_close_rel(y[i:i + 1], want[i:i + 1], TOL, f"mma {k}x{n} m={m} row {i}")
    assert torch.equal(y, kernels.gptq_matmul(x, w)), "the product must not depend on leftover scratch"


def test_gptq_mma_large_inputs_and_strided_rows(kernels: native.CudaKernels) -> None:
    """Inputs of a few hundred (fp32 accumulation keeps them) and x a row slice of a wider tensor."""
    w = make_gptq(4096, 4096, 128, dtype=F16, device="cuda", seed=3)
    wide = random((40, 4096 + 64), F16, seed=4, scale=300.0, device="cuda")
    x = wide[:, 64:]
    y = kernels.gptq_matmul(x, w, out=poisoned((40, 4096), F16, "cuda"))
    assert_close_rel(y, gptq_oracle(x, w), TOL, "mma large strided")


def test_gptq_mma_in_a_cuda_graph(kernels: native.CudaKernels) -> None:
    w = make_gptq(4096, 11008, 128, dtype=F16, device="cuda", seed=5)
    x = random((50, 4096), F16, seed=6, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.gptq_matmul(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernels.gptq_matmul(x, w)
    x.copy_(random((50, 4096), F16, seed=7, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close_rel(y, gptq_oracle(x, w), TOL, "mma graph replay")



@pytest.mark.parametrize("name", ["gptq_v1_sym_g32", "dense_fp16", "head32"])
def test_lane_replays_a_graph_for_a_chat_turn(checkpoints: Any, name: str) -> None:
    """A short chunk fed to a lane with graphs (padded to 16 rows) gives the eager forward's logits, cache and
    tokens; a chunk whose padding would pass the end of the cache runs eagerly."""
    lm = load_model(checkpoints.get(name).path, device="cuda", max_seq_len=160)
    model = lm.model
    graphs, eager = Lane(model, model.new_cache(160), True), Lane(model, model.new_cache(160), False)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, model.config.vocab_size, (60,), generator=g).tolist()
    for lane in (graphs, eager):
        lane.feed(prompt, None)
    assert graphs.graph is not None
    for chunk in (23, 23, 7, 16, 20):  # the last one at 129: 32 padded rows would pass 160
        captured = len(graphs.graph.graphs)
        ids = torch.randint(3, model.config.vocab_size, (chunk,), generator=g).tolist()
        got, want = graphs.feed(ids, None), eager.feed(ids, None)
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 2e-2, f"{name}: a {chunk}-token chunk at {graphs.cache.seq_len - chunk}: {err:.3g}"
        assert graphs.cache.seq_len == eager.cache.seq_len and graphs.cache.tokens == eager.cache.tokens
    assert len(graphs.graph.graphs) == captured, "the chunk that cannot be padded runs eagerly"
    assert captured >= 2, "the chunks before it must have replayed graphs"
    n = graphs.cache.seq_len
    for index in range(len(model.layers)):
        a, b = graphs.cache.k[index], eager.cache.k[index]
        torch.testing.assert_close(a[:, :, :n].float(), b[:, :, :n].float(), rtol=2e-2, atol=2e-2)
