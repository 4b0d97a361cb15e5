"""What the prebuilt-wheel selection needs to know about a Python environment: Python version and platform, pip's
compatibility tags, torch and its CUDA, the NVIDIA driver, the GPUs, and whether kobold_backend_ext is installed.

kobold_backend.wheels runs this file by path with the target interpreter (the KoboldAI host's Python, say), which
may have none of this package's dependencies: it uses the standard library only (torch and pip's packaging are
read when present), runs on Python 3.8+, and imports nothing from kobold_backend. It prints one line,
`KOBOLD_BACKEND_PROBE <json>`; `kobold-backend doctor` imports it and calls probe() in-process.
"""

import ctypes
import json
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from typing import Any, Dict, List, Optional, Tuple


def _tags() -> List[str]:
    try:
        from pip._vendor.packaging import tags
    except ImportError:
        try:
            from packaging import tags
        except ImportError:
            return []
    return [str(t) for t in tags.sys_tags()]


def _nvidia_smi(args: List[str]) -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return ""
    try:
        proc = subprocess.run([smi] + args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def _driver() -> Tuple[Optional[int], Optional[str]]:
    names = ["nvcuda.dll"] if sys.platform == "win32" else ["libcuda.so.1", "libcuda.dylib"]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        value = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(value)) == 0 and value.value > 0:
            return value.value, "libcuda"
    match = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", _nvidia_smi([]))
    if match:
        return int(match.group(1)) * 1000 + int(match.group(2)) * 10, "nvidia-smi"
    return None, None


def _gpus(torch: Any) -> List[List[Any]]:
    gpus: List[List[Any]] = []
    for line in _nvidia_smi(["--query-gpu=name,compute_cap", "--format=csv,noheader"]).splitlines():
        name, _, cap = line.rpartition(",")
        match = re.match(r"\s*(\d+)\.(\d+)", cap)
        if match:
            gpus.append([name.strip(), [int(match.group(1)), int(match.group(2))]])
    if not gpus and torch is not None and getattr(torch.version, "cuda", None) and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            gpus.append([torch.cuda.get_device_name(i), list(torch.cuda.get_device_capability(i))])
    return gpus


def probe() -> Dict[str, Any]:
    info: Dict[str, Any] = {
        "python": platform.python_version(), "executable": sys.executable, "platform": sysconfig.get_platform(),
        "tags": _tags(), "torch": None, "torch_cuda": None, "torch_hip": None, "torch_error": None,
    }
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install raising anything
        torch = None
        info["torch_error"] = f"{type(exc).__name__}: {exc}"
    else:
        info["torch"] = str(torch.__version__)
        info["torch_cuda"] = getattr(torch.version, "cuda", None)
        info["torch_hip"] = getattr(torch.version, "hip", None)
    info["driver_cuda"], info["driver_source"] = _driver()
    info["gpus"] = _gpus(torch)
    try:
        from importlib import metadata
        info["installed_ext"] = metadata.version("kobold_backend_ext")
    except Exception:  # not installed (or no importlib.metadata)
        info["installed_ext"] = None
    return info


if __name__ == "__main__":
    print("KOBOLD_BACKEND_PROBE " + json.dumps(probe()))
