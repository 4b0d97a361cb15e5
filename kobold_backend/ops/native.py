"""Loads the compiled kernels (prebuilt module -> JIT build -> torch reference), checks their fingerprints,
and keeps the resolved implementation per device kind.

The modules `kobold_backend._ext_cpu` and `kobold_backend._ext_cuda` take data pointers, shapes, strides,
dtype codes and the CUDA stream as plain integers; the wrappers (ops/cpu_kernels.py, ops/cuda_kernels.py)
allocate outputs with torch and pass their addresses, so a binary does not depend on libtorch's C++ ABI.
`kobold-backend doctor` prints what is loaded here (kobold_backend/doctor.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import mmap
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import kobold_backend
from kobold_backend.errors import ExtensionError
from kobold_backend.ops import build
from kobold_backend.ops.cpu_kernels import CpuKernels
from kobold_backend.ops.cuda_kernels import CudaKernels

log = logging.getLogger(__name__)

ENV_MODE = "KOBOLD_BACKEND_EXT"
ENV_CACHE = "KOBOLD_BACKEND_CACHE"
MODES = ("auto", "prebuilt", "jit", "torch")
KINDS = ("cpu", "cuda")


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
    spec = None
    if name not in sys.modules:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError as exc:  # the import below reports any other missing module
            if exc.name in (name, package):
                return None
        else:
            if spec is None:
                return None
    if spec is not None and spec.origin and os.path.isfile(spec.origin):
        _refuse_other_sources(kind, "prebuilt", spec.origin)
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


def prebuilt_origin(module: Any) -> str:
    """Where a prebuilt module came from, in words: built into this package, or the prebuilt-wheel package."""
    package = str(getattr(module, "__name__", "")).split(".")[0]
    if package == PREBUILT_PACKAGES[1]:
        return f"from the prebuilt wheel {package}, installed by `kobold-backend install-ext`"
    return "built into the kobold_backend package by `pip install .` or `setup.py build_ext`"


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


def _rebuild_hint(origin: str) -> str:
    if origin == "JIT-built":
        return f"delete {cache_root()} to rebuild it"
    return ("install the matching kernels with `kobold-backend install-ext` (`bash scripts/setup.sh` in a checkout), "
            "or rebuild them with `pip install .`")


_EXPECTED: Dict[str, Optional[str]] = {}


def expected_sources(kind: str) -> Optional[str]:
    """The digest of the kernel sources this package holds (build.sources_digest), or None without them."""
    if kind not in _EXPECTED:
        try:
            _EXPECTED[kind] = build.sources_digest(kind)
        except build.BuildError:
            _EXPECTED[kind] = None
    return _EXPECTED[kind]


def _other_sources(kind: str, origin: str, file: str, found: str, expected: str) -> ExtensionError:
    return ExtensionError(
        f"The {origin} {kind.upper()} kernel module {file} was built from other kernel sources ({found[:12]}) than "
        f"this kobold_backend's ({expected[:12]}); {_rebuild_hint(origin)}."
    )


_LIBRARY_MAGIC = (b"\x7fELF", b"MZ\x90\x00", b"\xcf\xfa\xed\xfe")  # ELF, PE, Mach-O 64


def _refuse_other_sources(kind: str, origin: str, file: str) -> None:
    """Refuse a module file that does not hold this package's sources digest, before importing it: a process keeps
    the first extension module of a name it imports, so a stale one imported would shadow a fresh JIT build."""
    expected = expected_sources(kind)
    if expected is None:
        return
    with open(file, "rb") as f:
        if f.read(4) not in _LIBRARY_MAGIC:  # anything else fails at import, saying so
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:  # a CUDA module is tens of MB: no copy
            held = data.find(expected.encode()) >= 0
    if not held:
        raise _other_sources(kind, origin, file, "unknown", expected)


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
    expected = expected_sources(kind)
    if expected is not None and fp.get("sources") != expected:
        raise _other_sources(kind, origin, file, str(fp.get("sources")), expected)
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
                return LoadResult(kind, "prebuilt", prebuilt_origin(module), module, module.__file__, fp, problems)
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
