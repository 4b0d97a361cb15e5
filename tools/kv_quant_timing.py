"""Times the KV cache dtypes on the GPU: one decode step's attention of a Llama-2-7B layer (32 heads of 128)
over fp16, q8, q4 and k8v4 caches, and greedy decode steps (CUDA graphs) of a Llama-2-7B-shaped GPTQ model cut to
--layers layers, at each context; each with the templated flash-decoding kernel (csrc/cuda/flash_decode.cu, "new")
and the previous kernels (KOBOLD_BACKEND_ATTN=legacy, "old") in the same process; prints microseconds, the cache
bytes read per microsecond (GB/s) and cache MiB; and a 512-token prompt per cache dtype with the q8 prompt's
heaviest kernels. The full-model figures come from
`kobold-backend bench --cache-dtype q8 --contexts 4000,16000` (docs/performance.md).

Run on a GPU machine from the repository root after building the kernels: `PYTHONPATH=. python
tools/kv_quant_timing.py` (the `kvtiming` section of tools/device_session.sh does).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator, List

import torch

from kobold_backend import ops
from kobold_backend.bench.checkpoint import PRESETS, write_synthetic_gptq
from kobold_backend.bench.timing import random_ids
from kobold_backend.engine.cache import CACHE_DTYPES
from kobold_backend.engine.decode_graph import GraphDecoder
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.model import Model
from kobold_backend.ops import native
from kobold_backend.ops.kv_quant import BITS, QuantizedKV, bytes_per_vector

NAMES = ("fp16", "q8", "q4", "k8v4")
KERNELS = ("old", "new")


@contextlib.contextmanager
def kernel(which: str) -> Iterator[None]:
    """The previous attention kernels ("old": KOBOLD_BACKEND_ATTN=legacy, read at each launch) or the new one."""
    saved = os.environ.pop("KOBOLD_BACKEND_ATTN", None)
    if which == "old":
        os.environ["KOBOLD_BACKEND_ATTN"] = "legacy"
    try:
        yield
    finally:
        os.environ.pop("KOBOLD_BACKEND_ATTN", None)
        if saved is not None:
            os.environ["KOBOLD_BACKEND_ATTN"] = saved


def graph_us(fn: Callable[[], object], repeats: int = 50) -> float:
    """Microseconds of one call replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeats


def _buffer(x: torch.Tensor, scheme: str) -> object:
    if scheme not in BITS:
        return x
    return QuantizedKV.empty(tuple(x.shape), BITS[scheme], torch.float16, "cuda").copy_(x)


def attention_table(contexts: List[int]) -> None:
    print("one layer's decode attention (32 query heads x 128; 32 KV heads as Llama-2-7B, 8 as Llama-3-8B), "
          "graph-replayed: us (GB/s of cache read)")
    for hkv in (32, 8):
        for n in contexts:
            g = torch.Generator(device="cuda").manual_seed(n)
            k = torch.randn(1, hkv, n, 128, device="cuda", generator=g).half()
            v = torch.randn(1, hkv, n, 128, device="cuda", generator=g).half()
            q = torch.randn(1, 32, 128, device="cuda", generator=g).half()
            pos = torch.tensor([n - 1], device="cuda")
            for name in NAMES:
                ks, vs = CACHE_DTYPES[name]
                kc, vc = _buffer(k, ks), _buffer(v, vs)
                nbytes = hkv * n * (bytes_per_vector(ks, 128, 2) + bytes_per_vector(vs, 128, 2))
                row = []
                for which in KERNELS:
                    with kernel(which):
                        us = graph_us(functools.partial(ops.decode_attention_at, q, kc, vc, pos, n, 128 ** -0.5))
                    row.append(f"{which} {us:7.1f} ({nbytes / us / 1e3:5.0f})")
                if name == "fp16":  # ops runs fp16 graph decode through torch's matmuls; the native kernel beside it
                    native_at = functools.partial(native.cuda_kernels().decode_attention_at, q, kc, vc, pos, n,
                                                  128 ** -0.5)
                    us = graph_us(native_at)
                    row.append(f"native {us:7.1f} ({nbytes / us / 1e3:5.0f})")
                print(f"  kv heads {hkv:2d} ctx {n:6d} {name:5s}: " + "   ".join(row))
                del kc, vc


def prompt_table(model: Model, vocab: int, tokens: int = 512, repeats: int = 5) -> None:
    """A prompt of `tokens` into an empty cache per dtype (ms), and the q8 prompt's heaviest CUDA kernels: the
    quantized prompt path's cost (issue #30: 0.39x of fp16's prompt speed) in a form a profile can act on."""
    ids = random_ids(tokens, vocab, 1, "cuda")
    print(f"prompt of {tokens} tokens into an empty cache ({len(model.layers)} layers): ms")
    cells = []
    for name in NAMES:
        cache = model.new_cache(cache_dtype=name)
        for _ in range(2):
            cache.reset()
            model.forward(ids, cache)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            cache.reset()
            model.forward(ids, cache)
        end.record()
        torch.cuda.synchronize()
        cells.append(f"{name} {start.elapsed_time(end) / repeats:7.3f}")
        if name == "q8":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                cache.reset()
                model.forward(ids, cache)
                torch.cuda.synchronize()
            profile = prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60)
        del cache
    print("  " + "   ".join(cells))
    print("  q8 prompt, heaviest CUDA kernels:")
    print("\n".join("  " + line for line in profile.splitlines()[:12]))


def decode_table(contexts: List[int], layers: int, steps: int) -> None:
    shape = dataclasses.replace(PRESETS["llama2-7b"], layers=layers)
    with tempfile.TemporaryDirectory(prefix="kvq-timing-") as tmp:
        path = write_synthetic_gptq(Path(tmp) / "m", shape, max_position_embeddings=max(contexts) + 512)
        lm = load_model(path, device="cuda", max_seq_len=max(contexts) + 256, with_tokenizer=False)
    model = lm.model
    prompt_table(model, shape.vocab)
    print(f"greedy decode step of a Llama-2-7B shape cut to {layers} layers (CUDA graphs): ms per token, "
          "cache MiB for the whole model (32 layers)")
    for name in NAMES:
        for which in KERNELS:
            cache = model.new_cache(cache_dtype=name)
            with kernel(which):  # read when the graphs are captured
                graph = GraphDecoder(model, cache)
                cells = []
                for n in contexts:
                    ids = random_ids(n, shape.vocab, n, "cuda")
                    cache.reset()
                    model.forward(ids[:, :-1], cache)
                    token = int(ids[0, -1])
                    for _ in range(3):
                        token = int(torch.argmax(graph.step(token)))
                    cache.truncate(n - 1)
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(steps):
                        token = int(torch.argmax(graph.step(token)))
                    end.record()
                    torch.cuda.synchronize()
                    cells.append(f"ctx {n}: {start.elapsed_time(end) / steps:6.3f} ms")
            mib = cache.nbytes / layers * 32 / 2**20 / cache.max_seq_len * 4096
            print(f"  {name:5s} {which} " + "   ".join(cells) + f"   ({mib:,.0f} MiB per 4096 tokens)")
            del graph, cache
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="4000,16000")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    attention_table(contexts)
    decode_table(contexts, args.layers, args.steps)


if __name__ == "__main__":
    main()
