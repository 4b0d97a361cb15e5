"""The `kobold-backend` command: generate, serve, doctor, bench, install-plugin, install-ext.

Results go to stdout; progress and logs go to stderr.
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
from kobold_backend.progress import stderr_progress

if TYPE_CHECKING:
    from kobold_backend.engine.loader import LoadedModel

log = logging.getLogger("kobold_backend")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every subcommand that loads a model."""
    parser.add_argument("--model", help="model folder (safetensors; dense or GPTQ 4-bit). Default: the demo model")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--dtype", default=None, help="compute dtype on the GPU: float16 or bfloat16")
    parser.add_argument("--max-context", type=int, default=None, help="KV cache size in tokens")
    parser.add_argument("--rope-alpha", type=float, default=1.0, help="NTK RoPE alpha (exllama's -a)")
    parser.add_argument("--compress-pos-emb", type=float, default=1.0, help="linear RoPE compression")
    parser.add_argument("--embed-on-cpu", action="store_true", help="keep the embedding table in system RAM")
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
    p = sub.add_parser("generate", help="stream a continuation of a prompt to stdout")
    add_model_arguments(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.92)
    p.add_argument("--rep-pen", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.set_defaults(func=run_generate)


def run_doctor(args: argparse.Namespace) -> int:
    from kobold_backend.doctor import doctor_report

    sys.stdout.write(doctor_report() + "\n")
    return 0


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="print Python, torch, CUDA, GPUs and which kernel path is active and why")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kobold-backend", description="Llama-family inference for KoboldAI frontends")
    parser.add_argument("--version", action="version", version=f"kobold-backend {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command")
    _add_generate(sub)
    _add_doctor(sub)
    for module, adder, runner in SUBCOMMANDS:
        _add_optional(sub, module, adder, runner)
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


if __name__ == "__main__":
    sys.exit(main())
