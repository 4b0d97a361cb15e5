"""Loads the compiled kernels (prebuilt module -> JIT build -> torch reference) and wraps them as torch ops.

The modules `kobold_backend._ext_cpu` and `kobold_backend._ext_cuda` take data pointers, shapes, strides,
dtype codes and the CUDA stream as plain integers; the wrappers here allocate outputs with torch and pass
their addresses, so a binary does not depend on libtorch's C++ ABI.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import kobold_backend
from kobold_backend.errors import ExtensionError
from kobold_backend.ops import build, reference

log = logging.getLogger(__name__)

ENV_MODE = "KOBOLD_BACKEND_EXT"
ENV_CACHE = "KOBOLD_BACKEND_CACHE"
MODES = ("auto", "prebuilt", "jit", "torch")
KINDS = ("cpu", "cuda")
GEMV_MAX_ROWS = 8

_DTYPE_CODES: Dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# Scratch per (device, stream) for split-K GEMV and split-sequence attention: 16 MiB + 256 KiB.
_WS_FLOATS = 1 << 22
_WS_COUNTERS = 1 << 16


def current_mode() -> str:
    value = os.environ.get(ENV_MODE, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ExtensionError(f"{ENV_MODE}={value!r} is not one of {', '.join(MODES)}; unset it or pick one of those.")
    return value


def cache_root() -> Path:
    """Where JIT builds go: $KOBOLD_BACKEND_CACHE, else $XDG_CACHE_HOME/kobold_backend/ext, else ~/.cache/..."""
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kobold_backend" / "ext"


# ---------------------------------------------------------------------------------------------- loading


@dataclass
class LoadResult:
    """Which implementation serves one device kind, and why."""

    kind: str
    path: str  # "prebuilt", "jit" or "torch"
    reason: str
    module: Any = None
    file: Optional[str] = None
    fingerprint: Optional[Dict[str, Any]] = None
    problems: List[str] = field(default_factory=list)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _module_name(kind: str) -> str:
    return f"kobold_backend._ext_{kind}"


# Where a prebuilt module may live: built into the package (`pip install .`), else the prebuilt-wheel package
# `kobold_backend_ext` (`kobold-backend install-ext`, see kobold_backend/wheels.py).
PREBUILT_PACKAGES = ("kobold_backend", "kobold_backend_ext")


def _import_prebuilt(kind: str) -> Any:
    """The installed module, or None when none is installed; ExtensionError when one exists but fails."""
    for package in PREBUILT_PACKAGES:
        module = _import_prebuilt_from(package, kind)
        if module is not None:
            return module
    return None


def _import_prebuilt_from(package: str, kind: str) -> Any:
    name = f"{package}._ext_{kind}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name in (name, package):
            return None
        raise ExtensionError(
            f"The prebuilt kernel module {name} failed to import ({_one_line(exc)}); reinstall kobold-backend "
            f"(`pip install --force-reinstall .`) or set {ENV_MODE}=torch."
        ) from exc
    except (ImportError, OSError) as exc:
        raise ExtensionError(
            f"The prebuilt kernel module {name} failed to import ({_one_line(exc)}); rebuild it with `pip install .` "
            f"for this Python and platform, or set {ENV_MODE}=jit to compile it here."
        ) from exc


def _import_file(kind: str, file: Path) -> Any:
    try:
        spec = importlib.util.spec_from_file_location(_module_name(kind), str(file))
        if spec is None or spec.loader is None:
            raise ImportError(f"no loader for {file}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (ImportError, OSError) as exc:
        raise ExtensionError(
            f"The JIT-built kernel module {file} failed to import ({_one_line(exc)}); delete {file.parent} "
            f"to rebuild it, or set {ENV_MODE}=torch."
        ) from exc


def arch_supported(capability: Tuple[int, int], archs: Sequence[str]) -> bool:
    """Whether code for `archs` (e.g. ["80", "86", "90+PTX"]) runs on a GPU of this compute capability."""
    for arch in archs:
        ptx = arch.upper().endswith("+PTX")
        core = arch[: -len("+PTX")] if ptx else arch
        specific = core.endswith("a")
        digits = core.rstrip("a")
        if not digits.isdigit() or len(digits) < 2:
            continue
        major, minor = int(digits[:-1]), int(digits[-1])
        if specific:
            if (major, minor) == tuple(capability):
                return True
            continue
        if major == capability[0] and minor <= capability[1]:
            return True
        if ptx and (major, minor) <= tuple(capability):
            return True
    return False


def check_fingerprint(
    fp: Dict[str, Any],
    kind: str,
    origin: str,
    file: str,
    driver_version: Optional[int] = None,
    gpus: Sequence[Tuple[str, Tuple[int, int]]] = (),
) -> None:
    """Raise ExtensionError (one sentence) when a module cannot serve this package, driver or GPUs."""
    version = kobold_backend.__version__
    if fp.get("kind") != kind:
        raise ExtensionError(
            f"The {origin} kernel module {file} reports kind {fp.get('kind')!r} instead of {kind!r}; "
            f"reinstall kobold-backend (`pip install --force-reinstall .`)."
        )
    if fp.get("version") != version:
        raise ExtensionError(
            f"The {origin} kernel module {file} was built for kobold_backend {fp.get('version')} but this is "
            f"kobold_backend {version}; rebuild it with `pip install .` (or delete it so {ENV_MODE}=auto "
            f"compiles a matching one)."
        )
    if kind != "cuda":
        return
    built = str(fp.get("cuda_version") or "0.0")
    built_major = int(built.split(".")[0] or 0)
    if driver_version is not None:
        if driver_version <= 0:
            raise ExtensionError(
                f"The {origin} CUDA kernel module {file} cannot reach an NVIDIA driver; install the NVIDIA "
                f"driver or set {ENV_MODE}=torch."
            )
        if driver_version // 1000 < built_major:
            supported = f"{driver_version // 1000}.{driver_version % 1000 // 10}"
            raise ExtensionError(
                f"The {origin} CUDA kernel module {file} was built with CUDA {built}, but the NVIDIA driver "
                f"supports CUDA {supported} at most; update the driver, or build the module with a CUDA "
                f"{driver_version // 1000} toolkit (`pip install .` with that nvcc)."
            )
    archs = [str(a) for a in fp.get("archs") or []]
    for index, (name, cap) in enumerate(gpus):
        if not arch_supported(cap, archs):
            raise ExtensionError(
                f"The {origin} CUDA kernel module {file} holds code for sm {' '.join(archs)} but GPU {index} "
                f"({name}) is sm_{cap[0]}{cap[1]}; rebuild it with KOBOLD_BACKEND_CUDA_ARCH=\"{cap[0]}.{cap[1]}\" "
                f"(`pip install .`)."
            )


def _visible_gpus() -> List[Tuple[str, Tuple[int, int]]]:
    return [
        (torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
        for i in range(torch.cuda.device_count())
    ]


def _validate(module: Any, kind: str, origin: str) -> Dict[str, Any]:
    file = str(getattr(module, "__file__", None) or _module_name(kind))
    try:
        fp = dict(module.fingerprint())
    except Exception as exc:  # a foreign or broken module: report it, whatever it raised
        raise ExtensionError(
            f"The {origin} kernel module {file} has no usable fingerprint() ({_one_line(exc)}); rebuild it with "
            f"`pip install .`."
        ) from exc
    if kind == "cuda":
        check_fingerprint(fp, kind, origin, file, int(module.driver_version()), _visible_gpus())
    else:
        check_fingerprint(fp, kind, origin, file)
    return fp


def jit_unavailable_reason(kind: str) -> Optional[str]:
    """None when a JIT build of `kind` can be attempted here, else why not."""
    try:
        build.source_dir()
    except build.BuildError:
        return "the kernel sources (csrc) are not installed"
    if not build.find_cxx():
        return "no C++ compiler was found (set CXX or install g++)"
    if kind == "cuda" and not build.find_nvcc():
        return "nvcc was not found (install the CUDA toolkit or set CUDA_HOME)"
    if not build.python_include():
        return "Python.h was not found (install the python3-dev package)"
    if not build.pybind11_include():
        return "pybind11 is not installed (pip install pybind11)"
    return None


def _jit_build(kind: str) -> Path:
    """Build (or reuse) the module in the cache; a failed build leaves no files behind."""
    key = build.jit_key(kind)
    root = cache_root()
    final = root / f"{kind}-{key}"
    file = final / f"_ext_{kind}{build.ext_suffix()}"
    if file.is_file():
        return file
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-{key}-", dir=str(root)))
    try:
        sys.stderr.write(f"kobold_backend: compiling the {kind.upper()} kernels into {final} (once per version)\n")
        if kind == "cuda":
            build.build_cuda(tmp / file.name)
        else:
            build.build_cpu(tmp / file.name)
        try:
            os.rename(tmp, final)  # atomic publish
        except OSError:
            if not file.is_file():  # not a lost race with another process: a real failure
                raise
    except (build.BuildError, OSError) as exc:
        flag = "--cuda" if kind == "cuda" else "--cpu"
        raise ExtensionError(
            f"Compiling the {kind.upper()} kernels failed ({_one_line(exc)[:300]}); run `python -m "
            f"kobold_backend.ops.build {flag}` to see the compiler output, or set {ENV_MODE}=torch."
        ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return file


def load(kind: str, mode: Optional[str] = None) -> LoadResult:
    """Find the implementation for `kind` ("cpu" or "cuda") following `mode` (default: $KOBOLD_BACKEND_EXT).

    auto: prebuilt -> JIT -> torch, logging each problem as one sentence; prebuilt/jit: only that path,
    raising ExtensionError when it fails; torch: the reference ops.
    """
    mode = mode or current_mode()
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    if mode == "torch":
        return LoadResult(kind, "torch", f"{ENV_MODE}=torch")
    if kind == "cuda" and not torch.cuda.is_available():
        return LoadResult(kind, "torch", "torch sees no CUDA device")
    problems: List[str] = []
    if mode in ("auto", "prebuilt"):
        try:
            module = _import_prebuilt(kind)
            if module is None:
                missing = f"no prebuilt {_module_name(kind)} is installed"
                if mode == "prebuilt":
                    raise ExtensionError(
                        f"{ENV_MODE}=prebuilt but {missing}; build it with `pip install .` (or `python setup.py "
                        f"build_ext --inplace`), install a prebuilt wheel with `kobold-backend install-ext`, or set "
                        f"{ENV_MODE}=auto."
                    )
                problems.append(missing)
            else:
                fp = _validate(module, kind, "prebuilt")
                return LoadResult(kind, "prebuilt", "installed module", module, module.__file__, fp, problems)
        except ExtensionError as exc:
            if mode == "prebuilt":
                raise
            log.warning("%s", exc)
            problems.append(str(exc))
    if mode in ("auto", "jit"):
        why = jit_unavailable_reason(kind)
        if why:
            if mode == "jit":
                raise ExtensionError(f"{ENV_MODE}=jit but {why}.")
            problems.append(f"no JIT build: {why}")
        else:
            try:
                file = _jit_build(kind)
                module = _import_file(kind, file)
                fp = _validate(module, kind, "JIT-built")
                return LoadResult(kind, "jit", "compiled from csrc/", module, str(file), fp, problems)
            except ExtensionError as exc:
                if mode == "jit":
                    raise
                log.warning("%s", exc)
                problems.append(str(exc))
    return LoadResult(kind, "torch", "; ".join(problems) or "no native module", problems=problems)


class _Slot:
    """The resolved implementation of one device kind, loaded on first use."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.resolved = False
        self.kernels: Any = None
        self.result: Optional[LoadResult] = None
        self.error: Optional[ExtensionError] = None
        self.lock = threading.Lock()

    def resolve(self) -> Any:
        with self.lock:
            if not self.resolved:
                try:
                    self.result = load(self.kind)
                    if self.result.module is not None:
                        wrapper = CudaKernels if self.kind == "cuda" else CpuKernels
                        self.kernels = wrapper(self.result.module)
                    log.info("kobold_backend %s kernels: %s (%s)", self.kind, self.result.path, self.result.reason)
                except ExtensionError as exc:
                    self.error = exc
                self.resolved = True
        if self.error is not None:
            raise self.error
        return self.kernels


_SLOTS = {kind: _Slot(kind) for kind in KINDS}


def cpu_kernels() -> Optional[CpuKernels]:
    """The loaded CPU kernels, or None when the torch reference serves CPU tensors."""
    slot = _SLOTS["cpu"]
    return slot.kernels if slot.resolved and slot.error is None else slot.resolve()


def cuda_kernels() -> Optional[CudaKernels]:
    """The loaded CUDA kernels, or None when the torch reference serves CUDA tensors."""
    slot = _SLOTS["cuda"]
    return slot.kernels if slot.resolved and slot.error is None else slot.resolve()


def reset() -> None:
    """Forget the resolved implementations (the next op loads again, e.g. after changing the env var)."""
    for kind in KINDS:
        _SLOTS[kind] = _Slot(kind)


def status() -> Dict[str, Any]:
    """Which path serves CPU and CUDA tensors and why (resolving both now if needed)."""
    report: Dict[str, Any] = {}
    try:
        report["mode"] = current_mode()
    except ExtensionError as exc:
        report["mode"] = str(exc)
    for kind in KINDS:
        slot = _SLOTS[kind]
        try:
            slot.resolve()
        except ExtensionError:
            pass
        if slot.error is not None:
            report[kind] = {"path": "error", "reason": str(slot.error)}
            continue
        result = slot.result
        assert result is not None
        report[kind] = {
            "path": result.path,
            "reason": result.reason,
            "file": result.file,
            "fingerprint": result.fingerprint,
        }
    return report


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


def _wheel_lines() -> List[str]:
    """The prebuilt-wheel decision (kobold_backend/wheels.py) as doctor lines; one line if that check fails."""
    try:
        from kobold_backend import wheels

        return wheels.doctor_lines()
    except Exception as exc:  # the doctor reports every failure instead of raising
        return [f"Prebuilt wheel check failed: {_one_line(exc)}"]


def doctor_report() -> str:
    """A multi-line report: Python, torch, CUDA runtime and driver, GPUs, and the active kernel paths."""
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
    info = status()
    lines.append(f"kobold_backend {kobold_backend.__version__}, {ENV_MODE}={info['mode']}")
    lines += _wheel_lines()
    for kind in KINDS:
        entry = info[kind]
        where = f" {entry['file']}" if entry.get("file") else ""
        lines.append(f"{kind.upper()} kernels: {entry['path']}{where} ({entry['reason']})")
        fp = entry.get("fingerprint")
        if fp:
            details = ", ".join(f"{k}={v}" for k, v in sorted(fp.items()) if k != "kind")
            lines.append(f"  fingerprint: {details}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- wrappers


def _out(out: Optional[torch.Tensor], shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out must be {like.dtype} {tuple(shape)} on {like.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, last] view whose last dimension is contiguous (copying only when it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _no_tensor() -> None:
    return None


def _ref(t: Optional[torch.Tensor]) -> Any:
    return _no_tensor if t is None else weakref.ref(t)


# id(GPTQWeight) -> weak references to it and its tensors, plus the device and sizes it was checked for.
_GPTQ_CHECKED: Dict[int, Tuple[Any, ...]] = {}


def _check_gptq(w: Any, device: torch.device) -> None:
    """Shapes, dtypes and devices the kernels rely on (raising here avoids reading out of bounds).

    The result is remembered per weight object and its tensors, so a decode step pays a few identity tests.
    """
    entry = _GPTQ_CHECKED.get(id(w))
    if (entry is not None and entry[0]() is w and entry[1]() is w.qweight and entry[2]() is w.scales
            and entry[3]() is w.zeros and entry[4]() is w.perm and entry[5]() is w.bias and entry[6] == device
            and entry[7] == (w.in_features, w.out_features, w.group_size)):
        return
    k, n, gs = w.in_features, w.out_features, w.group_size
    groups = -(-k // gs) if gs > 0 else 0
    problems = []
    if gs <= 0:
        problems.append(f"group_size {gs}")
    if w.qweight.dtype != torch.int32 or tuple(w.qweight.shape) != (-(-k // 8), n) or not w.qweight.is_contiguous():
        problems.append(f"qweight {w.qweight.dtype} {tuple(w.qweight.shape)}")
    for name in ("scales", "zeros"):
        t = getattr(w, name)
        if tuple(t.shape) != (groups, n) or not t.is_contiguous():
            problems.append(f"{name} {tuple(t.shape)}")
    if w.perm is not None and (w.perm.dtype != torch.int64 or tuple(w.perm.shape) != (k,)
                               or not w.perm.is_contiguous()):
        problems.append(f"perm {w.perm.dtype} {tuple(w.perm.shape)}")
    if w.bias is not None and (tuple(w.bias.shape) != (n,) or not w.bias.is_contiguous()):
        problems.append(f"bias {tuple(w.bias.shape)}")
    tensors = [w.qweight, w.scales, w.zeros, w.perm, w.bias]
    if any(t is not None and t.device != device for t in tensors):
        problems.append(f"tensors not all on {device}")
    if problems:
        raise ValueError(f"malformed GPTQWeight [{k}x{n}, group {gs}]: " + ", ".join(problems))
    if len(_GPTQ_CHECKED) > 100_000:
        _GPTQ_CHECKED.clear()
    _GPTQ_CHECKED[id(w)] = (weakref.ref(w), _ref(w.qweight), _ref(w.scales), _ref(w.zeros), _ref(w.perm),
                            _ref(w.bias), device, (k, n, gs))


class CpuKernels:
    """The ops of kobold_backend/ops/__init__.py on CPU tensors through `_ext_cpu` (fp32, fp16, bf16)."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dtype not in _DTYPE_CODES or weight.dtype not in _DTYPE_CODES or weight.shape != x.shape[-1:]:
            return reference.rms_norm(x, weight, eps)
        x2, w = _rows(x), weight.contiguous()
        y = _out(out, x.shape, x)
        self.module.rms_norm(x2.data_ptr(), x2.stride(0), 0, 0, _DTYPE_CODES[x.dtype], x2.shape[0], x2.shape[1],
                             w.data_ptr(), _DTYPE_CODES[w.dtype], float(eps), y.data_ptr(), 0,
                             torch.get_num_threads())
        return y

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     out: Optional[torch.Tensor] = None, residual_out: Optional[torch.Tensor] = None
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
        if (x.dtype not in _DTYPE_CODES or residual.dtype != x.dtype or residual.shape != x.shape
                or weight.dtype not in _DTYPE_CODES or weight.shape != x.shape[-1:]):
            return reference.add_rms_norm(x, residual, weight, eps)
        x2, r2, w = _rows(x), _rows(residual), weight.contiguous()
        y, ro = _out(out, x.shape, x), _out(residual_out, x.shape, x)
        self.module.rms_norm(x2.data_ptr(), x2.stride(0), r2.data_ptr(), r2.stride(0), _DTYPE_CODES[x.dtype],
                             x2.shape[0], x2.shape[1], w.data_ptr(), _DTYPE_CODES[w.dtype], float(eps),
                             y.data_ptr(), ro.data_ptr(), torch.get_num_threads())
        return y, ro

    def gptq_dequantize(self, w: Any, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if w.scales.dtype not in _DTYPE_CODES or w.zeros.dtype != w.scales.dtype:
            return reference.gptq_dequantize(w)
        _check_gptq(w, w.qweight.device)
        y = _out(out, (w.in_features, w.out_features), w.scales)
        self.module.gptq_dequantize(w.qweight.data_ptr(), w.in_features, w.out_features, w.scales.data_ptr(),
                                    w.zeros.data_ptr(), _DTYPE_CODES[w.scales.dtype], w.group_size,
                                    w.scales.shape[0], y.data_ptr(), torch.get_num_threads())
        return y

    def gptq_matmul(self, x: torch.Tensor, w: Any, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if (x.dim() != 2 or x.shape[1] != w.in_features or x.dtype not in _DTYPE_CODES
                or w.scales.dtype not in _DTYPE_CODES or w.zeros.dtype != w.scales.dtype
                or (w.bias is not None and w.bias.dtype not in _DTYPE_CODES)):
            return reference.gptq_matmul(x, w)
        m = x.shape[0]
        if not (1 <= m <= GEMV_MAX_ROWS and w.group_size % 8 == 0):
            y = self._dequant_matmul(x, w)
            return y if out is None else _out(out, y.shape, x).copy_(y)
        _check_gptq(w, x.device)
        x2 = _last_contiguous(x)
        y = _out(out, (m, w.out_features), x)
        bias = w.bias
        self.module.gptq_gemv(
            x2.data_ptr(), _DTYPE_CODES[x.dtype], x2.stride(0), m, w.in_features,
            0 if w.perm is None else w.perm.data_ptr(), w.qweight.data_ptr(), w.out_features,
            w.scales.data_ptr(), w.zeros.data_ptr(), _DTYPE_CODES[w.scales.dtype], w.group_size, w.scales.shape[0],
            0 if bias is None else bias.data_ptr(), _DTYPE_CODES[bias.dtype] if bias is not None else 0,
            y.data_ptr(), _DTYPE_CODES[x.dtype], torch.get_num_threads())
        return y

    def _dequant_matmul(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        if w.perm is not None:
            x = x.index_select(-1, w.perm)
        y = torch.matmul(x, self.gptq_dequantize(w).to(x.dtype))
        if w.bias is not None:
            y = y + w.bias.to(y.dtype)
        return y

    def rope_cache_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not _rope_supported(q, k, v, cos, sin, k_cache, v_cache, _DTYPE_CODES):
            return reference.rope_cache_write(q, k, v, cos, sin, pos, k_cache, v_cache)
        b, t, hq, d = q.shape
        _check_rope_range(pos, t, k_cache.shape[2], cos.shape[0], sin.shape[0])
        q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
        q_out = _out(out, q.shape, q)
        self.module.rope_cache_write(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), _DTYPE_CODES[q.dtype], q.stride()[:3], k.stride()[:3],
            v.stride()[:3], b, t, hq, k.shape[2], d, cos.data_ptr(), sin.data_ptr(), _DTYPE_CODES[cos.dtype],
            cos.stride(0), sin.stride(0), int(pos), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride()[:3],
            v_cache.stride()[:3], q_out.data_ptr(), torch.get_num_threads())
        return q_out

    def rope_cache_write_at(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if q.dim() != 4 or q.shape[1] != 1 or pos.numel() != 1:
            return reference.rope_cache_write_at(q, k, v, cos, sin, pos, k_cache, v_cache)
        return self.rope_cache_write(q, k, v, cos, sin, int(pos), k_cache, v_cache, out=out)

    def decode_attention_at(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                            length: int, scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if pos.numel() != 1:
            return reference.decode_attention_at(q, k_cache, v_cache, pos, length, scale)
        return self.decode_attention(q, k_cache, v_cache, min(int(pos) + 1, length), scale, out=out)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len: int,
                         scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not _attention_supported(q, k_cache, v_cache, seq_len, _DTYPE_CODES):
            return reference.decode_attention(q, k_cache, v_cache, seq_len, scale)
        q = _last_contiguous(q)
        y = _out(out, q.shape, q)
        b, hq, d = q.shape
        self.module.decode_attention(
            q.data_ptr(), _DTYPE_CODES[q.dtype], q.stride(0), q.stride(1), b, hq, k_cache.shape[1], d,
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride()[:3], v_cache.stride()[:3], int(seq_len),
            float(scale), y.data_ptr(), torch.get_num_threads())
        return y

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if gate.dtype not in _DTYPE_CODES or up.dtype != gate.dtype or up.shape != gate.shape:
            return reference.silu_mul(gate, up)
        g, u = gate.contiguous(), up.contiguous()
        y = _out(out, gate.shape, gate)
        self.module.silu_mul(g.data_ptr(), u.data_ptr(), _DTYPE_CODES[g.dtype], g.numel(), y.data_ptr(),
                             torch.get_num_threads())
        return y


_CUDA_CODES: Dict[torch.dtype, int] = {torch.float16: 1}


def _rope_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, codes: Dict[torch.dtype, int]) -> bool:
    if q.dim() != 4 or k.dim() != 4 or k_cache.dim() != 4:
        return False
    b, t, _, d = q.shape
    hkv = k.shape[2]
    return (
        q.dtype in codes and all(x.dtype == q.dtype for x in (k, v, k_cache, v_cache))
        and cos.dtype in (torch.float32, q.dtype) and sin.dtype == cos.dtype
        and tuple(k.shape) == (b, t, hkv, d) and tuple(v.shape) == (b, t, hkv, d)
        and k_cache.shape[0] == b and k_cache.shape[1] == hkv and k_cache.shape[3] == d
        and v_cache.shape == k_cache.shape and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        and cos.dim() == 2 and cos.shape[1] == d and sin.shape == cos.shape
        and cos.stride(-1) == 1 and sin.stride(-1) == 1 and d % 2 == 0
    )


def _check_rope_range(pos: int, t: int, cache_len: int, cos_len: int, sin_len: int) -> None:
    if pos < 0 or pos + t > min(cache_len, cos_len, sin_len):
        raise ValueError(f"positions {pos}..{pos + t - 1} fall outside the cache ({cache_len}) or the RoPE "
                         f"tables ({cos_len})")


def _attention_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len: int,
                         codes: Dict[torch.dtype, int]) -> bool:
    if q.dim() != 3 or k_cache.dim() != 4:
        return False
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    if not (q.dtype in codes and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
            and k_cache.shape[0] == b and k_cache.shape[3] == d and v_cache.shape == k_cache.shape
            and hkv > 0 and hq % hkv == 0 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1):
        return False
    if not 1 <= seq_len <= k_cache.shape[2]:
        raise ValueError(f"seq_len {seq_len} is outside 1..{k_cache.shape[2]} (the cache length)")
    return True


class CudaKernels:
    """The ops on fp16 CUDA tensors through `_ext_cuda` (other dtypes use the torch reference)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self._workspaces: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        # torch's own fast accessor of the current cudaStream_t (what its compiler uses), if this torch has it.
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def _stream(self, device: torch.device) -> int:
        if self._raw_stream is not None:
            return int(self._raw_stream(device.index))
        return torch.cuda.current_stream(device).cuda_stream

    def _workspace(self, device: torch.device, stream: int) -> Tuple[int, int, int, int]:
        key = (device.index, stream)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = (torch.empty(_WS_FLOATS, dtype=torch.float32, device=device),
                  torch.zeros(_WS_COUNTERS, dtype=torch.int32, device=device))
            self._workspaces[key] = ws
        return ws[0].data_ptr(), _WS_FLOATS, ws[1].data_ptr(), _WS_COUNTERS

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if (x.dtype != torch.float16 or weight.dtype not in (torch.float16, torch.float32)
                or weight.shape != x.shape[-1:] or weight.device != x.device):
            return reference.rms_norm(x, weight, eps)
        x2, w = _rows(x), weight.contiguous()
        y = _out(out, x.shape, x)
        dev = x.device
        self.module.rms_norm(x2.data_ptr(), x2.stride(0), 0, 0, x2.shape[0], x2.shape[1], w.data_ptr(),
                             _DTYPE_CODES[w.dtype], float(eps), y.data_ptr(), 0, dev.index, self._stream(dev))
        return y

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     out: Optional[torch.Tensor] = None, residual_out: Optional[torch.Tensor] = None
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
        if (x.dtype != torch.float16 or residual.dtype != x.dtype or residual.shape != x.shape
                or weight.dtype not in (torch.float16, torch.float32) or weight.shape != x.shape[-1:]
                or residual.device != x.device or weight.device != x.device):
            return reference.add_rms_norm(x, residual, weight, eps)
        x2, r2, w = _rows(x), _rows(residual), weight.contiguous()
        y, ro = _out(out, x.shape, x), _out(residual_out, x.shape, x)
        dev = x.device
        self.module.rms_norm(x2.data_ptr(), x2.stride(0), r2.data_ptr(), r2.stride(0), x2.shape[0], x2.shape[1],
                             w.data_ptr(), _DTYPE_CODES[w.dtype], float(eps), y.data_ptr(), ro.data_ptr(),
                             dev.index, self._stream(dev))
        return y, ro

    def gptq_dequantize(self, w: Any, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if w.scales.dtype != torch.float16 or w.zeros.dtype != torch.float16:
            return reference.gptq_dequantize(w)
        dev = w.qweight.device
        _check_gptq(w, dev)
        y = _out(out, (w.in_features, w.out_features), w.scales)
        self.module.gptq_dequantize(w.qweight.data_ptr(), w.in_features, w.out_features, w.scales.data_ptr(),
                                    w.zeros.data_ptr(), w.group_size, w.scales.shape[0], y.data_ptr(), dev.index,
                                    self._stream(dev))
        return y

    def gptq_matmul(self, x: torch.Tensor, w: Any, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if (x.dim() != 2 or x.shape[1] != w.in_features or x.dtype != torch.float16
                or w.scales.dtype != torch.float16 or w.zeros.dtype != torch.float16
                or (w.bias is not None and w.bias.dtype != torch.float16)):
            return reference.gptq_matmul(x, w)
        m, n = x.shape[0], w.out_features
        dev = x.device
        _check_gptq(w, dev)
        gemv_ok = (1 <= m <= GEMV_MAX_ROWS and w.group_size % 8 == 0 and n % 4 == 0
                   and w.qweight.data_ptr() % 16 == 0 and w.scales.data_ptr() % 8 == 0
                   and w.zeros.data_ptr() % 8 == 0)
        if not gemv_ok:
            y = self._dequant_matmul(x, w)
            return y if out is None else _out(out, y.shape, x).copy_(y)
        x2 = _last_contiguous(x)
        y = _out(out, (m, n), x)
        stream = self._stream(dev)
        self.module.gptq_gemv(
            x2.data_ptr(), x2.stride(0), m, w.in_features, 0 if w.perm is None else w.perm.data_ptr(),
            w.qweight.data_ptr(), n, w.scales.data_ptr(), w.zeros.data_ptr(), w.group_size, w.scales.shape[0],
            0 if w.bias is None else w.bias.data_ptr(), y.data_ptr(), self._workspace(dev, stream), dev.index,
            stream)
        return y

    def _dequant_matmul(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        if w.perm is not None:
            x = x.index_select(-1, w.perm)
        y = torch.matmul(x, self.gptq_dequantize(w))
        if w.bias is not None:
            y = y + w.bias
        return y

    def rope_cache_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self._rope_ok(q, k, v, cos, sin, k_cache, v_cache):
            return reference.rope_cache_write(q, k, v, cos, sin, pos, k_cache, v_cache)
        _check_rope_range(pos, q.shape[1], k_cache.shape[2], cos.shape[0], sin.shape[0])
        return self._rope(q, k, v, cos, sin, int(pos), 0, k_cache, v_cache, out)

    def rope_cache_write_at(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One token at the position held by the device tensor `pos` (read by the kernel: graph-capturable)."""
        if (not self._rope_ok(q, k, v, cos, sin, k_cache, v_cache) or q.shape[1] != 1 or pos.numel() != 1
                or pos.dtype != torch.int64 or pos.device != q.device):
            return reference.rope_cache_write_at(q, k, v, cos, sin, pos, k_cache, v_cache)
        return self._rope(q, k, v, cos, sin, 0, pos.data_ptr(), k_cache, v_cache, out)

    @staticmethod
    def _rope_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        dev = q.device
        return (_rope_supported(q, k, v, cos, sin, k_cache, v_cache, _CUDA_CODES)
                and all(t.device == dev for t in (k, v, cos, sin, k_cache, v_cache)))

    def _rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              pos: int, pos_dev: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
              out: Optional[torch.Tensor]) -> torch.Tensor:
        dev = q.device
        b, t, hq, d = q.shape
        q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
        q_out = _out(out, q.shape, q)
        max_pos = min(k_cache.shape[2], cos.shape[0], sin.shape[0])
        self.module.rope_cache_write(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride()[:3], k.stride()[:3], v.stride()[:3], b, t, hq,
            k.shape[2], d, cos.data_ptr(), sin.data_ptr(), _DTYPE_CODES[cos.dtype], cos.stride(0), sin.stride(0),
            pos, pos_dev, max_pos, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride()[:3],
            v_cache.stride()[:3], q_out.data_ptr(), dev.index, self._stream(dev))
        return q_out

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len: int,
                         scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self._attention_ok(q, k_cache, v_cache, seq_len):
            return reference.decode_attention(q, k_cache, v_cache, seq_len, scale)
        return self._attention(q, k_cache, v_cache, seq_len, 0, scale, out)

    def decode_attention_at(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                            length: int, scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention over cache[:, :, :length] with positions after the device tensor `pos` masked."""
        if (not self._attention_ok(q, k_cache, v_cache, length) or pos.numel() != 1 or pos.dtype != torch.int64
                or pos.device != q.device):
            return reference.decode_attention_at(q, k_cache, v_cache, pos, length, scale)
        return self._attention(q, k_cache, v_cache, length, pos.data_ptr(), scale, out)

    @staticmethod
    def _attention_ok(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len: int) -> bool:
        dev = q.device
        return (_attention_supported(q, k_cache, v_cache, seq_len, _CUDA_CODES) and k_cache.device == dev
                and v_cache.device == dev and _attention_layout_ok(q, k_cache, v_cache))

    def _attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len: int, pos_dev: int,
                   scale: float, out: Optional[torch.Tensor]) -> torch.Tensor:
        dev = q.device
        q = _last_contiguous(q)
        y = _out(out, q.shape, q)
        b, hq, d = q.shape
        stream = self._stream(dev)
        self.module.decode_attention(
            q.data_ptr(), q.stride(0), q.stride(1), b, hq, k_cache.shape[1], d, k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.stride()[:3], v_cache.stride()[:3], int(seq_len), pos_dev, float(scale),
            y.data_ptr(), self._workspace(dev, stream), dev.index, stream)
        return y

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if gate.dtype != torch.float16 or up.dtype != gate.dtype or up.shape != gate.shape or up.device != gate.device:
            return reference.silu_mul(gate, up)
        g, u = gate.contiguous(), up.contiguous()
        y = _out(out, gate.shape, gate)
        dev = gate.device
        self.module.silu_mul(g.data_ptr(), u.data_ptr(), g.numel(), y.data_ptr(), dev.index, self._stream(dev))
        return y


def _attention_layout_ok(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The CUDA kernel's 16-byte K-row and 4-byte V-row loads: head_dim % 8 == 0, <= 256, aligned strides."""
    d = q.shape[-1]
    ks, vs = k_cache.stride(), v_cache.stride()
    return (d % 8 == 0 and d <= 256 and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 4 == 0
            and all(s % 8 == 0 for s in ks[:3]) and all(s % 2 == 0 for s in vs[:3]))
