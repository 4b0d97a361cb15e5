"""The `kobold-backend` command: generate, serve, doctor, bench, install-plugin, install-ext.

Results go to stdout; progress and logs go to stderr. Every flag is checked by its argparse `type` before anything
is loaded: a bad value is a usage error (one line on stderr naming the flag, exit status 2); a failure while running
(a model that does not load, a port in use) is exit status 1.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
from typing import TYPE_CHECKING, List, Optional

from kobold_backend import __version__
from kobold_backend.cli_split import add_split_arguments, split_from_args
from kobold_backend.errors import KoboldBackendError
from kobold_backend.flag_types import (
    ArgumentParser,
    HelpFormatter,
    device_name,
    dtype_name,
    existing_path,
    float_in,
    int_at_least,
)
from kobold_backend.progress import stderr_progress

if TYPE_CHECKING:
    from kobold_backend.engine.loader import LoadedModel

log = logging.getLogger("kobold_backend")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every subcommand that loads a model."""
    parser.add_argument("--model", type=existing_path, metavar="PATH",
                        help="model folder (safetensors: dense, GPTQ, AWQ) or a .gguf file (default: the built-in "
                             "demo model)")
    parser.add_argument("--device", type=device_name, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", type=dtype_name, default=None, metavar="{float16,bfloat16,float32}",
                        help="compute dtype (default: float16 on a GPU, bfloat16 for bf16 checkpoints, float32 on "
                             "the CPU)")
    parser.add_argument("--max-context", type=int_at_least(2), default=None, metavar="N",
                        help="KV cache size in tokens, at least 2 (default: the model's max_position_embeddings, "
                             "at most 8192)")
    parser.add_argument("--rope-alpha", type=float_in(0, above=True), default=1.0, help="NTK RoPE alpha (exllama's -a)")
    parser.add_argument("--compress-pos-emb", type=float_in(0, above=True), default=1.0,
                        help="linear RoPE compression factor")
    parser.add_argument("--embed-on-cpu", action="store_true", help="keep the embedding table in system RAM")
    parser.add_argument("--cache-dtype", choices=("fp16", "q8", "q4", "k8v4"), default="fp16",
                        help="KV cache storage: fp16 (the compute dtype), q8 or q4 (8- or 4-bit groups of 32 with "
                             "fp16 scales, about 53 %% / 28 %% of fp16 at head size 128), k8v4 (8-bit keys, 4-bit "
                             "values); see docs/kv-cache.md")
    add_split_arguments(parser)


def load_from_args(args: argparse.Namespace) -> LoadedModel:
    """Load --model (or build the demo model) with progress on stderr."""
    from kobold_backend.engine.loader import load_model

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
        progress=stderr_progress("loading"),
    )


def run_generate(args: argparse.Namespace) -> int:
    from kobold_backend.engine.generator import GenerationRequest, Generator
    from kobold_backend.engine.sampling import SamplerSettings

    lm = load_from_args(args)
    generator = Generator(lm.model, lm.tokenizer)
    settings = SamplerSettings(
        temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k, top_p=args.top_p,
        rep_pen=args.rep_pen,
    )
    prompt_ids = lm.tokenizer.encode(args.prompt, add_bos=True)
    request = GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=args.max_new_tokens, settings=settings,
                                seed=args.seed, stop_strings=tuple(args.stop or ()))
    for event in generator.stream(request):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = generator.stats
    rate = s.completion_tokens / s.decode_seconds if s.decode_seconds > 0 else 0.0
    log.info("%d prompt tokens in %.3f s, %d new tokens at %.1f tokens/s (%s)", s.prompt_tokens,
             s.prefill_seconds, s.completion_tokens, rate, s.finish_reason)
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a continuation of a prompt to stdout",
                       description="Load a model (or the demo model), continue --prompt and stream the text to "
                                   "stdout; timings go to stderr.")
    add_model_arguments(p)
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=100, metavar="N",
                   help="tokens to generate, at least 1")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--temperature", type=float_in(0), default=0.7, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-k", type=int_at_least(0), default=0, help="top-k, 0 = off")
    p.add_argument("--top-p", type=float_in(0, 1), default=0.92, help="top-p (nucleus), 1 = off")
    p.add_argument("--rep-pen", type=float_in(1), default=1.0, help="repetition penalty, 1 = off")
    p.add_argument("--seed", type=int_at_least(0, 2**64 - 1), default=None,
                   help="sampler seed (default: a random one)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.set_defaults(func=run_generate)


def run_doctor(args: argparse.Namespace) -> int:
    from kobold_backend.doctor import doctor_report

    sys.stdout.write(doctor_report() + "\n")
    return 0


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="print Python, torch, CUDA, GPUs and which kernel path is active and why",
                       description="Print Python, torch, CUDA, the GPUs, where the compiled kernels come from and "
                                   "which kernel path each device uses, and why.")
    p.set_defaults(func=run_doctor)


def _add_optional(sub: argparse._SubParsersAction, module: str, adder: str, runner: str) -> None:
    """Subcommands that live in their own modules (serve, host, wheels, bench)."""
    if importlib.util.find_spec(module) is None:
        return
    mod = importlib.import_module(module)
    if hasattr(mod, adder) and hasattr(mod, runner):
        parser = getattr(mod, adder)(sub)
        parser.set_defaults(func=getattr(mod, runner))


SUBCOMMANDS = [
    ("kobold_backend.cli_serve", "add_serve_parser", "run_serve"),
    ("kobold_backend.host.install", "add_install_plugin_parser", "run_install_plugin"),
    ("kobold_backend.wheels", "add_install_ext_parser", "run_install_ext"),
    ("kobold_backend.bench", "add_bench_parser", "run_bench"),
]


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="kobold-backend", description="Llama-family inference for KoboldAI frontends",
                            formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"kobold-backend {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    _add_doctor(sub)
    for module, adder, runner in SUBCOMMANDS:
        _add_optional(sub, module, adder, runner)
    for command in sub.choices.values():
        command.formatter_class = HelpFormatter
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KoboldBackendError as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for the person; the traceback with --verbose
        log.error("%s: %s", type(exc).__name__, exc)
        log.debug("traceback", exc_info=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
