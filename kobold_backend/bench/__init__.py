"""`kobold-backend bench`: this engine's speed on a model-shaped GPTQ checkpoint, optionally beside others.

Builds (or takes with --model) a checkpoint, measures prompt speed, decode speed at two contexts,
a prefix-reusing chat turn, peak memory and the copy-bandwidth roofline, and with --compare the
same figures for exllamav2 and transformers fp16 in the same process, or for llama.cpp's llama-bench on the same
GGUF file, with ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import platform
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from kobold_backend import __version__
from kobold_backend.bench.checkpoint import PRESETS, write_synthetic_gptq
from kobold_backend.errors import KoboldBackendError

log = logging.getLogger(__name__)
MAX_BENCH_CONTEXT = 1 << 20  # 2^20 tokens: a 7B's fp16 cache alone would be 512 GiB
REFERENCES = ("exllamav2", "transformers", "llamacpp")  # the engines --compare can time beside this one
DEFAULT_COMPARE = "exllamav2,transformers"


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from kobold_backend.flag_types import (
        add_threads_argument,
        device_name,
        existing_file,
        existing_path,
        int_at_least,
        model_path,
    )

    p = sub.add_parser("bench", help="measure speed (prompt, decode, chat turn, memory, roofline)",
                       description="Time prompt processing, decoding, a chat turn and memory on a model (or a "
                                   "synthetic GPTQ checkpoint of a preset's shape), optionally beside exllamav2 and "
                                   "transformers; docs/performance.md explains the figures.")
    p.add_argument("--model", type=model_path, metavar="DIR",
                   help="checkpoint folder (default: build a synthetic GPTQ one of --preset's shape)")
    p.add_argument("--preset", default="llama2-7b", choices=sorted(PRESETS), metavar="NAME",
                   help="shape of the synthetic checkpoint: " + ", ".join(sorted(PRESETS)))
    p.add_argument("--act-order", action="store_true", help="synthetic checkpoint with act-order g_idx")
    p.add_argument("--format", choices=("gptq", "exl2", "gguf"), default="gptq",
                   help="format of the synthetic checkpoint: GPTQ 4-bit, EXL2 at 4.0 bpw (exllamav2's mixed widths) "
                        "or a Q4_K_M GGUF file (llama shapes; needs `gguf`)")
    p.add_argument("--group-size", type=int_at_least(1), default=128, metavar="N",
                   help="GPTQ group size of the synthetic checkpoint")
    p.add_argument("--device", type=device_name, default="auto", help="auto, cpu, cuda or cuda:N")
    add_threads_argument(p)
    p.add_argument("--no-graphs", action="store_true", help="eager decode (debugging)")
    p.add_argument("--compare", nargs="?", const=DEFAULT_COMPARE, default=None, type=reference_list,
                   metavar="NAME[,NAME]",
                   help="also measure other engines: " + ", ".join(REFERENCES) + " (comma-separated; bare: "
                        + DEFAULT_COMPARE + "); llamacpp times llama-bench on the same GGUF file")
    p.add_argument("--llamacpp-bench", type=existing_file, default=None, metavar="PATH",
                   help="llama.cpp's llama-bench binary for --compare llamacpp (default: $LLAMA_BENCH)")
    p.add_argument("--samplers", action="store_true", help="also time the samplers per token (CPU)")
    p.add_argument("--speculative", action="store_true",
                   help="also time speculative decoding: n-gram drafts, the target drafting for itself and, with "
                        "--draft-preset or --draft-model, a draft model, on repetitive and random text")
    p.add_argument("--draft-preset", default=None, choices=sorted(PRESETS), metavar="NAME",
                   help="shape of a synthetic draft checkpoint for --speculative (e.g. qwen2.5-0.5b for qwen2.5-7b)")
    p.add_argument("--draft-model", type=model_path, default=None, metavar="DIR",
                   help="a real draft checkpoint for --speculative (instead of --draft-preset)")
    p.add_argument("--draft-tokens", type=int_at_least(1, 16), default=4, metavar="K",
                   help="tokens drafted per round for --speculative (default 4)")
    p.add_argument("--quick", action="store_true", help="short runs (for tests and tiny models)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE ('-' for stdout)")
    p.add_argument("--cache-dtype", default="fp16", type=cache_dtype_list, metavar="fp16|q8|q4|k8v4[,...]",
                   help="KV cache storage (docs/kv-cache.md); a comma-separated list times (or with --perplexity, "
                        "measures) each in turn")
    p.add_argument("--contexts", default=None, type=context_list, metavar="N,N",
                   help="decode contexts to time (default 128,4000); the cache holds the longest plus 608")
    p.add_argument("--perplexity", metavar="FILE", type=existing_path,
                   help="instead of timing: the perplexity of --model on this text file with each --cache-dtype")
    return p


def cache_dtype_list(text: str) -> List[str]:
    """--cache-dtype: one or more of engine/cache.py's CACHE_DTYPES, comma-separated."""
    from kobold_backend.engine.cache import CACHE_DTYPES

    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in CACHE_DTYPES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: use one or more of {', '.join(CACHE_DTYPES)}")
    return names


def reference_list(text: str) -> List[str]:
    """--compare: one or more of REFERENCES, comma-separated."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in REFERENCES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: use one or more of {', '.join(REFERENCES)}")
    return names


def context_list(text: str) -> List[int]:
    """--contexts: token counts from 2 to MAX_BENCH_CONTEXT, comma-separated (checked before a checkpoint is
    written)."""
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use token counts such as 4000,16000") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: every context must be at least 2 tokens")
    if max(values) > MAX_BENCH_CONTEXT:
        raise argparse.ArgumentTypeError(f"{text!r}: every context must be at most {MAX_BENCH_CONTEXT} tokens")
    return values


def environment() -> Dict[str, Any]:
    import torch  # here and below, not at the top: the parser (--help, a bad flag) answers without torch

    env: Dict[str, Any] = {"date": datetime.date.today().isoformat(), "kobold_backend": __version__,
                           "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda_runtime"] = torch.version.cuda
        try:
            from kobold_backend.ops.native import status

            env["kernels"] = status()
        except ImportError:
            env["kernels"] = "torch reference"
    return env


def _ratios(ours: Dict[str, Any], other: Dict[str, Any]) -> Dict[str, float]:
    out = {}
    for key in ("prompt_tokens_per_s", "decode_tokens_per_s"):
        for n, value in other.get(key, {}).items():
            if n in ours.get(key, {}) and value:
                out[f"{key}[{n}]"] = ours[key][n] / value
    if "chat_turn" in other and "chat_turn" in ours:
        out["chat_turn_ttft_speedup"] = other["chat_turn"]["ttft_s"] / ours["chat_turn"]["ttft_s"]
    return out


def _compared(bench: Any, path: str) -> Dict[str, Any]:
    """Another engine's figures, or why it could not run this checkpoint (not every engine runs every
    architecture); our own figures are kept either way."""
    try:
        return bench(path)
    except Exception as exc:  # the other engine's failure is a result of the comparison, not of this bench
        log.warning("%s failed: %s: %s", bench.__name__, type(exc).__name__, exc)
        import torch

        torch.cuda.empty_cache()
        return {"skipped": f"failed on this checkpoint ({type(exc).__name__}: {exc})"}


def _speculation(args: argparse.Namespace, path: str, tmp: Path, quick: bool) -> Dict[str, Any]:
    from kobold_backend.bench.speculative_bench import bench_speculation

    draft = args.draft_model
    if draft is None and args.draft_preset is not None:
        log.info("writing a synthetic %s GPTQ draft checkpoint", args.draft_preset)
        draft = str(write_synthetic_gptq(tmp / f"draft-{args.draft_preset}", PRESETS[args.draft_preset],
                                         args.group_size, seed=1, device="cpu" if args.device == "cpu" else None))
    log.info("measuring speculative decoding")
    shape = dict(prompt_length=96, steps=24, max_seq_len=256) if quick else {}
    return bench_speculation(path, None if draft is None else str(draft), args.device, args.draft_tokens,
                             use_graphs=not args.no_graphs, **shape)


def run_bench(args: argparse.Namespace) -> int:
    if args.perplexity:
        from kobold_backend.bench.perplexity import run_perplexity

        return run_perplexity(args)
    if args.format != "gptq" and (args.act_order or args.group_size != 128):
        raise KoboldBackendError(f"--act-order and --group-size shape the synthetic GPTQ checkpoint; --format "
                                 f"{args.format} writes its own layout, so drop them")
    if args.format == "gguf":
        _check_gguf_flags(args)
    compare = args.compare or []
    llama_bench = _check_llamacpp_flags(args) if "llamacpp" in compare else None
    quick = args.quick or args.preset.startswith("tiny")
    with _sigterm_unwinds(), tempfile.TemporaryDirectory(prefix="kobold-bench-") as tmp:
        path = args.model
        if path is None and args.format == "exl2":
            from kobold_backend.bench.exl2_checkpoint import write_synthetic_exl2

            log.info("writing a synthetic %s EXL2 4.0 bpw checkpoint", args.preset)
            path = str(write_synthetic_exl2(Path(tmp) / args.preset, PRESETS[args.preset],
                                            device="cpu" if args.device == "cpu" else None))
        elif path is None and args.format == "gguf":
            path = str(_synthetic_gguf(Path(tmp), args.preset))
        elif path is None:
            log.info("writing a synthetic %s GPTQ checkpoint%s", args.preset, " (act-order)" if args.act_order else "")
            path = str(write_synthetic_gptq(Path(tmp) / args.preset, PRESETS[args.preset], args.group_size,
                                            args.act_order, device="cpu" if args.device == "cpu" else None))
        shape = dict(prompt_lengths=(16, 64), contexts=(16, 100), decode_steps=8, chat_context=100, chat_new=10,
                     max_seq_len=256) if quick else {}
        if args.contexts:
            shape.update(contexts=tuple(args.contexts), max_seq_len=max(args.contexts) + 608)
        runs = [_measure(args, path, shape, compare, llama_bench, Path(tmp), quick, dtype, first=i == 0)
                for i, dtype in enumerate(args.cache_dtype)]
    result = runs[0] if len(runs) == 1 else {"cache_dtypes": dict(zip(args.cache_dtype, runs))}
    text = json.dumps(result, indent=2)
    if args.json == "-":
        sys.stdout.write(text + "\n")
    elif args.json:
        Path(args.json).write_text(text + "\n")
    sys.stderr.write("\n".join(format_table(r) for r in runs) + "\n")
    return 0


def _measure(args: argparse.Namespace, path: str, shape: Dict[str, Any], compare: List[str],
             llama_bench: Optional[str], tmp: Path, quick: bool, cache_dtype: str, first: bool) -> Dict[str, Any]:
    """One timing of the engine with `cache_dtype` (and its references); speculation and samplers once, on the
    first cache dtype of the list."""
    import torch

    from kobold_backend.bench.engine_bench import bench_engine

    log.info("measuring kobold-backend with a %s cache", cache_dtype)
    result: Dict[str, Any] = {"environment": environment(), "preset": None if args.model else args.preset,
                              "act_order": args.act_order, "model": args.model,
                              "format": None if args.model else args.format, "cache_dtype": cache_dtype,
                              "kobold_backend": bench_engine(path, args.device, use_graphs=not args.no_graphs,
                                                             cache_dtype=cache_dtype, threads=args.threads,
                                                             **shape)}
    if compare:
        from kobold_backend.bench.compare import bench_exllamav2, bench_transformers

        benches = {"exllamav2": bench_exllamav2, "transformers": bench_transformers}
        for name in (n for n in REFERENCES if n in compare and n != "llamacpp"):
            log.info("measuring %s", name)
            result[name] = _compared(benches[name], path) if torch.cuda.is_available() else \
                {"skipped": "no CUDA GPU"}
        result["ratios"] = {name: _ratios(result["kobold_backend"], result[name])
                            for name in compare if name != "llamacpp" and "skipped" not in result[name]}
        if llama_bench is not None:
            _compare_llamacpp(result, llama_bench, path, cache_dtype, shape)
    if first and args.speculative:
        result["speculation"] = _speculation(args, path, tmp, quick)
    if first and args.samplers:
        from kobold_backend.engine.sampling import benchmark_samplers

        result["samplers"] = {str(v): benchmark_samplers(v) for v in (32000, 128256)}
    return result


def _flat(tree: Dict[str, Any], prefix: str = "") -> Iterator[Tuple[str, float]]:
    """(dotted key, value) of every number in nested ratios, e.g. ("q4_k_m.decode_tokens_per_s.4000", 1.2)."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While the bench runs, SIGTERM (`timeout`, a job scheduler) unwinds like Ctrl-C, so the synthetic
    checkpoint's temporary folder (gigabytes) is removed instead of left behind; the previous handler comes back
    after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check_gguf_flags(args: argparse.Namespace) -> None:
    """--format gguf's preconditions, checked before anything is written: one sentence each."""
    if args.model is not None:
        raise KoboldBackendError("--format gguf writes a synthetic file of --preset's shape; drop it to bench --model")
    if PRESETS[args.preset].model_type != "llama":
        raise KoboldBackendError(f"--format gguf writes llama-shaped files; preset {args.preset} is "
                                 f"{PRESETS[args.preset].model_type} (pick llama2-7b, llama2-13b or llama3-8b)")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise KoboldBackendError("--format gguf writes the file with llama.cpp's `gguf` package, which is not "
                                 "installed here (pip install gguf).") from None


def _check_llamacpp_flags(args: argparse.Namespace) -> str:
    """--compare llamacpp's preconditions, checked before anything is written: the llama-bench binary (flag or
    $LLAMA_BENCH) and a GGUF file for both engines to time."""
    from kobold_backend.bench.llamacpp import check_llama_bench, find_llama_bench

    binary = find_llama_bench(None if args.llamacpp_bench is None else str(args.llamacpp_bench))
    if binary is None:
        raise KoboldBackendError("--compare llamacpp needs llama.cpp's llama-bench binary: pass --llamacpp-bench PATH "
                                 "or set LLAMA_BENCH.")
    if args.model is None and args.format != "gguf":
        raise KoboldBackendError("--compare llamacpp times a GGUF file: pass --model FILE.gguf or --format gguf.")
    if args.model is not None:
        from kobold_backend.engine.gguf.checkpoint import is_gguf

        if not is_gguf(Path(args.model)):
            raise KoboldBackendError(f"--compare llamacpp times a GGUF file; {args.model} is not one.")
    return check_llama_bench(binary)


def _compare_llamacpp(result: Dict[str, Any], binary: str, path: str, cache_dtype: str,
                      shape: Dict[str, Any]) -> None:
    """llama-bench on the same file at the same prompt lengths and contexts; its failure is recorded as the
    comparison's result (one sentence), our figures are kept."""
    from kobold_backend.bench.llamacpp import (
        LlamaBenchError,
        bench_llamacpp,
        gguf_file_type,
        llamacpp_ratios,
        variant_label,
    )

    sizes = {k: shape[k] for k in ("prompt_lengths", "contexts", "decode_steps") if k in shape}
    log.info("measuring llama.cpp (%s)", binary)
    try:
        result["llamacpp"] = bench_llamacpp(binary, path, cache_dtype, **sizes)
    except LlamaBenchError as exc:
        log.warning("%s", exc)
        result["llamacpp"] = {"skipped": str(exc)}
        return
    label = variant_label(gguf_file_type(path), cache_dtype)
    result["llamacpp"]["variant"] = label
    result["ratios"]["llamacpp"] = {label: llamacpp_ratios(result["kobold_backend"], result["llamacpp"])}


def _synthetic_gguf(folder: Path, preset: str) -> Path:
    from kobold_backend.bench.gguf_checkpoint import write_synthetic_gguf

    log.info("writing a synthetic %s Q4_K_M GGUF file", preset)
    return write_synthetic_gguf(folder / f"{preset}-Q4_K_M.gguf", PRESETS[preset])


def format_table(result: Dict[str, Any]) -> str:
    """A short human-readable summary."""
    lines = []
    for name in ("kobold_backend",) + REFERENCES:
        r = result.get(name)
        if not r:
            continue
        if "skipped" in r:
            lines.append(f"{name:15s} skipped: {r['skipped']}")
            continue
        prompt = ", ".join(f"{k}: {v:,.0f}" for k, v in r.get("prompt_tokens_per_s", {}).items())
        decode = ", ".join(f"ctx {k}: {v:,.1f}" for k, v in r.get("decode_tokens_per_s", {}).items())
        lines.append(f"{name:15s} prompt tok/s [{prompt}]  decode tok/s [{decode}]")
        if "chat_turn" in r:
            ct = r["chat_turn"]
            lines.append(f"{'':15s} chat turn TTFT {ct['ttft_s'] * 1e3:.1f} ms vs full prefill "
                         f"{ct['full_prefill_s'] * 1e3:.1f} ms")
    kb = result["kobold_backend"]
    lines.append(f"KV cache {kb.get('cache_dtype', 'fp16')}: {kb['cache_bytes'] / 2**20:,.1f} MiB")
    bandwidth = kb["copy_bandwidth_bytes_per_s"] / 1e12
    lines.append(f"roofline {kb['roofline_tokens_per_s']:,.0f} tok/s at {bandwidth:.2f} TB/s copy bandwidth")
    for other, ratios in result.get("ratios", {}).items():
        lines.append(f"vs {other}: " + ", ".join(f"{k} x{v:.2f}" for k, v in _flat(ratios)))
    if "speculation" in result:
        from kobold_backend.bench.speculative_bench import format_speculation

        lines.extend(format_speculation(result["speculation"]))
    return "\n".join(lines)
