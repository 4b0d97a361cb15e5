"""The `kobold-backend` command: generate, serve, doctor, bench, install-plugin, install-ext.

Results go to stdout; progress and logs go to stderr. Every flag is checked by its argparse `type` before anything
is loaded: a bad value is a usage error (one line on stderr naming the flag, exit status 2); a failure while running
(a model that does not load, a port in use) is exit status 1; Ctrl-C is one line and exit status 130. Nothing here
imports torch before the arguments are parsed (--help, --version and a usage error answer at once): the modules
that need it are imported inside the subcommands.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import math
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, List, Optional

from kobold_backend import __version__
from kobold_backend.cli.model_args import add_model_arguments, checked_speculation_kwargs, load_from_args
from kobold_backend.cli.serve import add_serve_parser, run_serve
from kobold_backend.errors import KoboldBackendError
from kobold_backend.flag_types import ArgumentParser, HelpFormatter, float_in, int_at_least

if TYPE_CHECKING:
    from kobold_backend.engine.request import GenerationRequest

log = logging.getLogger("kobold_backend")


def generate_request(args: argparse.Namespace, tokenizer: Any) -> GenerationRequest:
    """`generate`'s flags as the engine's request (the prompt is not trimmed: the generator refuses one that does
    not fit)."""
    from kobold_backend.engine.request import GenerationRequest
    from kobold_backend.engine.sampler_fields import cli_defaults
    from kobold_backend.engine.sampling import SamplerSettings

    values = {name: getattr(args, name) for name in cli_defaults()}
    if args.greedy:
        values["temperature"] = 0.0
    settings = SamplerSettings(**values)
    return GenerationRequest(prompt_ids=tokenizer.encode(args.prompt, add_bos=True),
                             max_new_tokens=args.max_new_tokens, settings=settings, seed=args.seed,
                             stop_strings=tuple(args.stop or ()))


def run_generate(args: argparse.Namespace) -> int:
    checked_speculation_kwargs(args)  # a bad combination of flags is a usage error before torch is imported
    from kobold_backend.engine.generator import Generator

    lm = load_from_args(args)
    generator = Generator(lm.model, lm.tokenizer)
    generator.use_speculation(lm.speculation)
    for event in generator.stream(generate_request(args, lm.tokenizer)):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = generator.stats
    rate = s.completion_tokens / s.decode_seconds if s.decode_seconds > 0 else 0.0
    log.info("%d prompt tokens in %.3f s, %d new tokens at %.1f tokens/s (%s)", s.prompt_tokens,
             s.prefill_seconds, s.completion_tokens, rate, s.finish_reason)  # the generator logs the speculation
    return 0


def add_sampler_flag(parser: argparse.ArgumentParser, name: str, default: float) -> None:
    """--NAME for one sampler setting: its type, range and help from engine/sampler_fields.py (the KoboldAI range,
    as the HTTP routes check it)."""
    from kobold_backend.engine.sampler_fields import BY_NAME

    f = BY_NAME[name]
    low, high = f.wire_range()
    if f.kind == "integer":
        kind = int_at_least(int(low if low is not None else -(2**63)), None if high is None else int(high))
    else:
        kind = float_in(-math.inf if low is None else low, math.inf if high is None else high)
    parser.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=f.doc)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a continuation of a prompt to stdout",
                       description="Load a model (or the demo model), continue --prompt and stream the text to "
                                   "stdout; timings go to stderr.")
    add_model_arguments(p)
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=100, metavar="N",
                   help="tokens to generate, at least 1")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    from kobold_backend.engine.sampler_fields import cli_defaults

    for name, default in cli_defaults().items():  # the settings engine/sampler_fields.py makes flags here
        add_sampler_flag(p, name, default)
    p.add_argument("--seed", type=int_at_least(0, 2**64 - 1), default=None,
                   help="sampler seed (default: a random one)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.set_defaults(func=run_generate)


def run_doctor(args: argparse.Namespace) -> int:
    from kobold_backend.doctor import doctor_report

    sys.stdout.write(doctor_report(args.model) + "\n")
    return 0


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="print Python, torch, CUDA, GPUs and which kernel path is active and why",
                       description="Print Python, torch, CUDA, the GPUs, where the compiled kernels come from and "
                                   "which kernel path each device uses, and why.")
    p.add_argument("--model", default=None, help="also name this model's architecture, weight format and bits "
                                                 "per weight (a folder or a .gguf file; only headers are read)")
    p.set_defaults(func=run_doctor)


def _add_optional(sub: argparse._SubParsersAction, module: str, adder: str, runner: str) -> None:
    """Subcommands that live in other rooms (host, wheels, bench), added when their module is present."""
    if importlib.util.find_spec(module) is None:
        return
    mod = importlib.import_module(module)
    if hasattr(mod, adder) and hasattr(mod, runner):
        parser = getattr(mod, adder)(sub)
        parser.set_defaults(func=getattr(mod, runner))


SUBCOMMANDS = [
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
    add_serve_parser(sub).set_defaults(func=run_serve)
    for module, adder, runner in SUBCOMMANDS:
        _add_optional(sub, module, adder, runner)
    for command in sub.choices.values():
        command.formatter_class = HelpFormatter
    return parser


class _Interrupt:
    """Ctrl-C (SIGINT) as the command sees it: the handler notes it and raises KeyboardInterrupt. The note stays
    when a library turns that KeyboardInterrupt into an error of its own (safetensors reading a tensor through
    torch does), so that error is reported as the interruption it is, not as a broken model."""

    seen = False

    @classmethod
    def handler(cls, signum: int, frame: Any) -> None:
        cls.seen = True
        raise KeyboardInterrupt

    @classmethod
    def install(cls) -> Any:
        """Install the handler (main thread only: elsewhere Ctrl-C never arrives); returns the one it replaced."""
        cls.seen = False
        if threading.current_thread() is not threading.main_thread():
            return None
        return signal.signal(signal.SIGINT, cls.handler)


def _interrupted() -> int:
    """One sentence on stderr (after the progress bar's line on a terminal) and exit status 130, as shells use.
    Log records from here on (torch logs statistics at exit when its import was cut short) are dropped."""
    logging.disable(logging.WARNING)
    sys.stderr.write(("\n" if sys.stderr.isatty() else "") + "kobold-backend: stopped by Ctrl-C.\n")
    return 130


def main(argv: Optional[List[str]] = None) -> int:
    from kobold_backend.engine.cpu_threads import prepare_environment

    prepare_environment()  # before torch's OpenMP runtime starts: waiting threads sleep instead of spinning
    previous = _Interrupt.install()
    try:
        return _run(argv)
    except KeyboardInterrupt:
        return _interrupted()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _run(argv: Optional[List[str]]) -> int:
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
        if _Interrupt.seen:
            return _interrupted()
        log.error("%s", exc)
        return 1
    except Exception as exc:  # noqa: BLE001 - one line for the person; the traceback with --verbose
        if _Interrupt.seen:
            return _interrupted()
        log.error("%s: %s", type(exc).__name__, exc)
        log.debug("traceback", exc_info=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
