"""argparse pieces of the command lines (`kobold-backend`, `python -m kobold_backend.bench`): a parser whose usage
error is one line (exit 2), a help formatter that states each option's default, and the flag types that check a
value before anything loads (each raises ArgumentTypeError, which argparse reports as "argument --flag: message")."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Callable, NoReturn, Optional


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line usage error: `kobold-backend serve: error: argument --port: ...` (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless it already names its default or has none to name."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text.lower() or default is None or default is False or default in (argparse.SUPPRESS, [], ()):
            return text
        if action.option_strings or action.nargs in ("?", "*"):
            return f"{text} (default: %(default)s)"
        return text


def int_at_least(minimum: int, maximum: Optional[int] = None) -> Callable[[str], int]:
    """An integer type in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum or (maximum is not None and value > maximum):
            span = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(minimum: float, maximum: float = math.inf, above: bool = False) -> Callable[[str], float]:
    """A finite float >= minimum (> minimum with above=True) and <= maximum."""

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        low_ok = value > minimum if above else value >= minimum
        if not (math.isfinite(value) and low_ok and value <= maximum):
            low = f"greater than {minimum:g}" if above else f"at least {minimum:g}"
            span = low if maximum == math.inf else f"{low} and at most {maximum:g}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text.strip()}")
        return value

    parse.__name__ = "number"
    return parse


def existing_dir(text: str) -> Path:
    """A folder that exists."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a folder")
    return path


def existing_file(text: str) -> Path:
    """A file that exists."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a file")
    return path


def existing_path(text: str) -> str:
    """A file or folder that exists (a model is a folder; the loader says what it needs inside)."""
    if not Path(text).expanduser().exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return str(Path(text).expanduser())


def model_path(text: str) -> str:
    """A model folder or a .gguf file (engine/model_path.py says what else it is; the loader checks inside)."""
    from kobold_backend.engine.model_path import model_path_problem

    path = Path(text).expanduser()
    problem = model_path_problem(path)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem.rstrip("."))
    return str(path)


DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def device_name(text: str) -> str:
    """auto, cpu, cuda or cuda:N."""
    value = text.strip().lower()
    if not DEVICE.match(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not one of auto, cpu, cuda, cuda:N")
    if value.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(value.split(":")[1]) if ":" in value else 0
        if index >= count:
            seen = "no CUDA GPU" if count == 0 else f"{count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
            raise argparse.ArgumentTypeError(f"{value} was asked for but this torch build sees {seen}")
    return value


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """--threads N, which the command passes to the engine; the engine applies it (engine/cpu_threads.py)."""
    from kobold_backend.engine.cpu_threads import MAX_THREADS, default_threads

    parser.add_argument("--threads", type=int_at_least(1, MAX_THREADS), default=None, metavar="N",
                        help=f"CPU threads for torch and the native CPU kernels, 1-{MAX_THREADS} (default: "
                             f"$OMP_NUM_THREADS if set, else the physical cores this process may use; "
                             f"{default_threads()} here)")


DTYPES = {"float16": "float16", "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32",
          "fp32": "float32"}


def dtype_name(text: str) -> str:
    """float16, bfloat16 or float32 (fp16, bf16 and fp32 too)."""
    value = DTYPES.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of float16, bfloat16, float32")
    return value
