"""Options shared by every subcommand that loads a model (--model, --device, --dtype, --max-context, RoPE, the
layer split, --threads) and the one function that loads a model from them, with progress on stderr."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any, Dict

from kobold_backend.cli.split import add_split_arguments, split_from_args
from kobold_backend.errors import RequestError
from kobold_backend.flag_types import (
    add_threads_argument,
    device_name,
    dtype_name,
    float_in,
    int_at_least,
    model_path,
)
from kobold_backend.progress import stderr_progress

if TYPE_CHECKING:
    from kobold_backend.engine.loader import LoadedModel

log = logging.getLogger("kobold_backend")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every subcommand that loads a model."""
    parser.add_argument("--model", type=model_path, metavar="PATH",
                        help="model folder (safetensors: dense, GPTQ, AWQ) or a .gguf file (default: the built-in "
                             "demo model)")
    parser.add_argument("--device", type=device_name, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", type=dtype_name, default=None, metavar="{float16,bfloat16,float32}",
                        help="compute dtype (default: float16 on a GPU, bfloat16 for bf16 checkpoints, float32 on "
                             "the CPU)")
    parser.add_argument("--max-context", type=int_at_least(2), default=None, metavar="N",
                        help="KV cache size in tokens, at least 2 (default: the model's max_position_embeddings, "
                             "at most 8192)")
    parser.add_argument("--rope-alpha", type=float_in(0, above=True), default=1.0, metavar="ALPHA",
                        help="NTK RoPE alpha (exllama's -a)")
    parser.add_argument("--compress-pos-emb", type=float_in(0, above=True), default=1.0, metavar="FACTOR",
                        help="linear RoPE compression factor")
    parser.add_argument("--embed-on-cpu", action="store_true", help="keep the embedding table in system RAM")
    parser.add_argument("--cache-dtype", choices=("fp16", "q8", "q4", "k8v4"), default="fp16",
                        help="KV cache storage: fp16 (the compute dtype), q8 or q4 (8- or 4-bit groups of 32 with "
                             "fp16 scales, about 53 %% / 28 %% of fp16 at head size 128), k8v4 (8-bit keys, 4-bit "
                             "values); see docs/kv-cache.md")
    parser.add_argument("--speculative", choices=("off", "ngram", "draft"), default=None,
                        help="speculative decoding: ngram (prompt lookup, no second model) or draft (needs "
                             "--draft-model, which implies it); default off")
    parser.add_argument("--draft-model", type=model_path, default=None, metavar="DIR",
                        help="a small model with the same tokenizer that drafts tokens for the target to verify")
    parser.add_argument("--draft-tokens", type=int_at_least(1, 16), default=None, metavar="K",
                        help="tokens drafted per round (default: 4 with a draft model, 5 with ngram)")
    add_threads_argument(parser)
    add_split_arguments(parser)


def load_from_args(args: argparse.Namespace) -> LoadedModel:
    """Load --model (or build the demo model) with progress on stderr."""
    from kobold_backend.engine.loader import load_model

    speculation = checked_speculation_kwargs(args)
    path = args.model
    if path is None:
        from kobold_backend.demo import ensure_demo_model

        path = ensure_demo_model(progress=stderr_progress("building demo model"))
        log.warning("no --model given: using the built-in demo model at %s", path)
    layer_devices = split_from_args(args, path, args.max_context)
    return load_model(
        path,
        device=args.device,
        layer_devices=layer_devices,
        dtype=args.dtype,
        max_seq_len=args.max_context,
        embed_on_cpu=args.embed_on_cpu,
        rope_alpha=args.rope_alpha,
        compress_pos_emb=args.compress_pos_emb,
        cache_dtype=args.cache_dtype,
        threads=args.threads,
        progress=stderr_progress("loading"),
        **speculation,
    )


def speculation_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """load_model's speculative-decoding keywords from the flags (none when the flags are not given); RequestError
    (its `field` the flag's dest) for a combination that cannot work."""
    kwargs: Dict[str, Any] = {}
    if args.draft_model is not None and args.speculative not in (None, "draft"):
        raise RequestError(f"goes with --speculative draft, not {args.speculative}", "draft_model")
    if args.speculative == "draft" and args.draft_model is None:
        raise RequestError("draft needs --draft-model DIR (a small model with the same tokenizer)", "speculative")
    if args.draft_tokens is not None and args.speculative in (None, "off") and args.draft_model is None:
        raise RequestError("needs --speculative ngram or --draft-model (speculative decoding is off)", "draft_tokens")
    if args.speculative is not None:
        kwargs["speculative"] = args.speculative
    if args.draft_model is not None:
        kwargs["draft_model"] = str(args.draft_model)
        kwargs.setdefault("speculative", "draft")
    if args.draft_tokens is not None:
        kwargs["draft_tokens"] = args.draft_tokens
    return kwargs


def checked_speculation_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """speculation_kwargs, a bad combination reported like a bad flag value before anything loads: one line
    `kobold-backend COMMAND: error: argument --flag: ...` on stderr, exit 2."""
    try:
        return speculation_kwargs(args)
    except RequestError as e:
        flag = "--" + e.field.replace("_", "-")
        sys.stderr.write(f"kobold-backend {getattr(args, 'command', '')}: error: argument {flag}: {e}\n")
        raise SystemExit(2) from None
