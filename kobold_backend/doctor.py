"""`kobold-backend doctor`: Python, torch, the NVIDIA driver, GPUs, which kernel path serves CPU and CUDA tensors
and why (kobold_backend/ops/native.py), and the prebuilt-wheel decision (kobold_backend/wheels.py), in words that
say which kernels are in use and never advise a step that would change nothing (a kernel wheel cannot replace the
modules compiled into the package: those are loaded first)."""

from __future__ import annotations

import ctypes
import platform
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

import kobold_backend
from kobold_backend import wheels
from kobold_backend.errors import ExtensionError
from kobold_backend.ops import native
from kobold_backend.ops.ggml import KERNEL_TYPES


def _driver_info() -> Tuple[Optional[str], Optional[int]]:
    """(driver version string, CUDA version the driver supports as 1000*major+10*minor), None when unknown."""
    version = None
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            for word in f.read().split():
                if word.count(".") >= 1 and word.replace(".", "").isdigit():
                    version = word
                    break
    except OSError:
        pass
    cuda = None
    names = ["nvcuda.dll"] if sys.platform == "win32" else ["libcuda.so.1", "libcuda.dylib"]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        value = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(value)) == 0:
            cuda = value.value
        break
    return version, cuda


def in_package(entry: Dict[str, Any]) -> bool:
    """Whether a kernel path of native.status() is a module compiled into this package (by scripts/setup.sh's
    build, `pip install .` or `setup.py build_ext`), which the loader takes before any installed wheel."""
    file = entry.get("file")
    return entry.get("path") == "prebuilt" and bool(file) and \
        Path(str(file)).resolve().parent == Path(kobold_backend.__file__).resolve().parent


def in_use_line(entry: Dict[str, Any]) -> str:
    """Which kernels serve this device, in words."""
    path, file = entry.get("path"), entry.get("file")
    if path == "prebuilt" and in_package(entry):
        return (f"  in use: the module compiled into this package ({Path(str(file)).name}); it is loaded before any "
                "installed kernel wheel")
    if path == "prebuilt":
        return f"  in use: the prebuilt kernel wheel's module ({file})"
    if path == "jit":
        return f"  in use: a module compiled from csrc/ on first use ({file})"
    return "  in use: torch's own operations (no compiled kernels; slower)"


def _wheel_advice(entry: Dict[str, Any], installed: Optional[str], status: Dict[str, Any]) -> str:
    """What installing the fitting wheel would do here: nothing when the package's own modules serve (they shadow
    it) or it is installed already; otherwise what `kobold-backend install-ext` replaces."""
    provided = [name[len("_ext_"):] for name in entry.get("modules", {})] or ["cpu"]
    if all(in_package(status.get(kind, {})) for kind in provided):
        kinds = " and ".join(kind.upper() for kind in provided)
        return (f"not needed: the {kinds} kernels compiled into this package are loaded before any wheel's, so "
                "installing it would change nothing")
    if installed is not None and installed == f"{entry.get('version')}+{entry.get('variant')}":
        return "installed"
    served = status.get("cpu", {}).get("path")
    instead = {"torch": " in place of torch's own operations", "jit": " in place of the module compiled on first "
               "use"}.get(str(served), "")
    return f"`kobold-backend install-ext` installs it{instead}"


def _wheel_lines(status: Dict[str, Any]) -> List[str]:
    """The prebuilt-wheel decision (kobold_backend/wheels.py) as doctor lines; one line if that check fails."""
    try:
        env = wheels.probe_here()
        installed = env.get("installed_ext")
        lines = [f"Prebuilt wheel installed: {wheels.DIST_NAME} {installed}" if installed else
                 f"Prebuilt wheel installed: none ({wheels.DIST_NAME} is not installed)"]
        index = wheels.default_index_path()
        if not index.is_file():
            return lines + [f"Prebuilt wheel index: none at {index}"]
        decision = wheels.select(env, wheels.load_index(index)["entries"])
    except Exception as exc:  # the doctor reports every failure instead of raising
        return ["Prebuilt wheel check failed: " + " ".join(str(exc).split())]
    if decision.entry is None:
        lines.append(f"Wheel for this environment: none ({'; '.join(decision.reasons)}); the kernels come from a "
                     "build here (scripts/setup.sh, or on first use) or torch's own operations")
    else:
        extra = f" (CPU only: {'; '.join(decision.reasons)})" if decision.reasons else ""
        lines.append(f"Wheel for this environment: {decision.entry['wheel']}{extra}; "
                     f"{_wheel_advice(decision.entry, installed, status)}")
    return lines


def model_line(path: str) -> str:
    """`model: <name>: <architecture>, <format>, <bpw> bpw` from the model's headers (or why it cannot run)."""
    from pathlib import Path

    from kobold_backend.engine.config import ModelConfig
    from kobold_backend.engine.stored_format import stored_format
    from kobold_backend.errors import ModelFormatError

    model = Path(path)
    try:
        config = ModelConfig.from_dir(model)
        fmt = stored_format(model)
    except (ModelFormatError, OSError, ValueError) as exc:
        return f"model: {model.name}: cannot be read ({exc})"
    return f"model: {model.name}: {config.architecture}, {fmt} as stored"


def _ggml_line(kind: str) -> str:
    """Whether the loaded module of `kind` has the GGML block kernels (GGUF files), else the torch path serves."""
    try:
        kernels = native.cpu_kernels() if kind == "cpu" else native.cuda_kernels()
    except ExtensionError:
        kernels = None
    native_ggml = kernels is not None and hasattr(kernels.module, "ggml_gemv")
    path = "native" if native_ggml else "torch (dequantize + matmul)"
    return f"  GGML block kernels ({' '.join(KERNEL_TYPES)}): {path}"


def doctor_report(model: Optional[str] = None) -> str:
    """A multi-line report: Python, torch, CUDA runtime and driver, GPUs, and the active kernel paths (and, with
    `model`, the model's architecture and weight format)."""
    lines = [
        f"Python {platform.python_version()} ({sys.executable}) on {platform.platform()}",
        f"torch {torch.__version__} (CUDA runtime {torch.version.cuda or 'none'})",
    ]
    driver, cuda = _driver_info()
    if driver or cuda:
        supports = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else "unknown"
        lines.append(f"NVIDIA driver {driver or 'unknown'} (supports CUDA {supports})")
    else:
        lines.append("NVIDIA driver: not found")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(
                f"GPU {i}: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
                f"{p.multi_processor_count} SMs"
            )
    else:
        lines.append("GPUs: none visible to torch")
    info = native.status()
    lines.append(f"kobold_backend {kobold_backend.__version__}, {native.ENV_MODE}={info['mode']}")
    lines += _wheel_lines(info)
    for kind in native.KINDS:
        entry = info[kind]
        where = f" {entry['file']}" if entry.get("file") else ""
        lines.append(f"{kind.upper()} kernels: {entry['path']}{where} ({entry['reason']})")
        if entry["path"] != "error":
            lines.append(in_use_line(entry))
        fp = entry.get("fingerprint")
        if fp:
            details = ", ".join(f"{k}={v}" for k, v in sorted(fp.items()) if k != "kind")
            lines.append(f"  fingerprint: {details}")
        if entry["path"] != "error":
            lines.append(_ggml_line(kind))
    if model is not None:
        lines.append(model_line(model))
    return "\n".join(lines)
