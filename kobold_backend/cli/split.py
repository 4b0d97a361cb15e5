"""The layer-split flags of every command that loads a model (--gpu-split, --cpu-layers) and their reading
into a plan of kobold_backend.engine.device_map; the CLI side of the split, kept out of the engine.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Union

from kobold_backend.errors import PlanError

if TYPE_CHECKING:
    from kobold_backend.engine.device_map import HardwareProbe


def parse_gpu_split(text: str) -> Union[str, Dict[str, float]]:
    """'auto', or comma-separated GB per GPU in index order ('20,24' -> cuda:0 20 GB, cuda:1 24 GB)."""
    text = text.strip().lower()
    if text == "auto":
        return "auto"
    out: Dict[str, float] = {}
    for i, part in enumerate(text.split(",")):
        try:
            value = float(part)
        except ValueError:
            raise PlanError(f"--gpu-split {text!r}: {part.strip()!r} is not a number of GB") from None
        if not value >= 0 or math.isinf(value):
            raise PlanError(f"--gpu-split {text!r}: {part.strip()!r} must be a finite number of GB >= 0")
        out[f"cuda:{i}"] = value
    return out


def parse_cpu_layers(text: Union[str, int, None]) -> Union[int, str, None]:
    """None, 'auto' or a number of layers from --cpu-layers."""
    if text is None or isinstance(text, int):
        return text
    text = text.strip().lower()
    if text == "auto":
        return "auto"
    if not text.isdigit():
        raise PlanError(f"--cpu-layers {text!r}: use a number of layers or 'auto'")
    return int(text)


def _checked(parse: Callable[[str], Any]) -> Callable[[str], str]:
    """An argparse type that runs `parse` on the text (so a bad value is a usage error naming the flag before
    anything loads) and keeps the text for split_from_args."""

    def check(text: str) -> str:
        try:
            parse(text)
        except PlanError as e:
            raise argparse.ArgumentTypeError(str(e).split(": ", 1)[-1]) from None
        return text

    check.__name__ = parse.__name__
    return check


def add_split_arguments(parser: argparse.ArgumentParser) -> None:
    """--gpu-split and --cpu-layers (for every subcommand that loads a model)."""
    parser.add_argument(
        "--gpu-split", metavar="GB,GB,...|auto", default=None, type=_checked(parse_gpu_split),
        help="split the layers over GPUs by memory budget: GB (2^30 bytes) per GPU in index order, e.g. 20,24, "
             "or 'auto' (each visible GPU's free memory minus 0.5 GB); planned from the checkpoint's headers "
             "before loading, counting weights, KV cache and working buffers")
    parser.add_argument(
        "--cpu-layers", metavar="N|auto", default=None, type=_checked(parse_cpu_layers),
        help="run N layers on the CPU (float32, system RAM) and the rest on the GPU(s); 'auto' puts on the CPU "
             "only what does not fit in the GPU budgets (without it, a model that does not fit is an error)")


def split_from_args(
    args: argparse.Namespace, folder: Union[str, Path], max_seq_len: Optional[int],
    probe: Optional[HardwareProbe] = None,
) -> Optional[List[str]]:
    """The layer_devices that --gpu-split / --cpu-layers ask for (None: no split), the plan logged. When there
    is a plan, `args.device` is set to its head device (where load_model puts norm and lm_head)."""
    from kobold_backend.engine.device_map import plan_split

    gpu_split = getattr(args, "gpu_split", None)
    plan = plan_split(
        folder, max_seq_len,
        gpu_split=None if gpu_split is None else parse_gpu_split(str(gpu_split)),
        cpu_layers=parse_cpu_layers(getattr(args, "cpu_layers", None)),
        device=str(getattr(args, "device", None) or "auto"),
        embed_on_cpu=bool(getattr(args, "embed_on_cpu", False)),
        dtype=getattr(args, "dtype", None),
        probe=probe,
        cache_dtype=getattr(args, "cache_dtype", None) or "fp16",
    )
    if plan is None:
        return None
    args.device = plan.head_device
    return None if plan.uniform else list(plan.layer_devices)
