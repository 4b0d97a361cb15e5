"""Compiles the native modules `kobold_backend._ext_cpu` (C++ compiler) and `kobold_backend._ext_cuda` (nvcc).

One set of flags serves setup.py, the JIT loader (ops/native.py) and the CI compile check
(`python -m kobold_backend.ops.build --check-cuda`). Standard library only: setup.py loads this file
by path in an isolated build environment without torch.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

DEFAULT_CUDA_ARCH = "8.0 8.6 8.9 9.0+PTX"
CPU_MODULE = "_ext_cpu"
CUDA_MODULE = "_ext_cuda"

_PACKAGE_DIR = Path(__file__).resolve().parents[1]


class BuildError(RuntimeError):
    """A compiler was missing or a compile/link step failed; the message names the step and its output."""


def source_dir() -> Path:
    """The kernel sources: `csrc/` of a source checkout, else the copy installed as `kobold_backend/_csrc`."""
    for candidate in (_PACKAGE_DIR.parent / "csrc", _PACKAGE_DIR / "_csrc"):
        if (candidate / "include" / "kb_common.h").is_file():
            return candidate
    raise BuildError(f"the kernel sources (csrc/) are not next to {_PACKAGE_DIR}; reinstall kobold-backend.")


def compile_root() -> Tuple[Path, Path]:
    """(the folder every compile runs in, the kernel sources relative to it). Relative source and include paths keep
    the checkout's location out of the binaries (`__FILE__` in the CUDA error messages), so
    a module built from another clone is byte-identical."""
    src = source_dir()
    return src.parent, Path(src.name)


def package_version() -> str:
    text = (_PACKAGE_DIR / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__\s*=\s*"([^"]+)"', text, re.M)
    if not match:
        raise BuildError("kobold_backend/__init__.py has no __version__")
    return match.group(1)


def ext_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def cpu_sources(src: Path) -> List[Path]:
    """The CPU kernel sources, the pybind11 binding last."""
    return [src / "cpu" / "ops_cpu.cpp", src / "cpu" / "ggml_cpu.cpp", src / "cpu" / "kv_quant_cpu.cpp",
            src / "cpu" / "module_cpu.cpp"]


def cuda_sources(src: Path) -> List[Path]:
    found = (src if src.is_absolute() else source_dir().parent / src) / "cuda"
    return sorted(src / "cuda" / f.name for f in found.glob("*.cu"))


def cuda_binding_source(src: Path) -> Path:
    return src / "cuda" / "module_cuda.cpp"


def _headers(src: Path) -> List[Path]:
    return sorted(p for p in src.rglob("*") if p.suffix in (".h", ".cuh"))


def digest_inputs(kind: str, src: Optional[Path] = None) -> List[Path]:
    """The files a module of `kind` is built from: the CPU module from csrc/cpu and csrc/include, the CUDA module
    from all of csrc/; each with this file (every flag)."""
    src = src or source_dir()
    folders = [src / "cpu", src / "include"] if kind == "cpu" else [src]
    files = {p for folder in folders for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    return sorted(files)


def sources_digest(kind: str, src: Optional[Path] = None) -> str:
    """sha256 over what a module of `kind` ("cpu" or "cuda") is built from (digest_inputs), each file named relative
    to csrc/ so a source checkout and an installed package (its copy in kobold_backend/_csrc) agree. The modules carry
    it in their fingerprint (`sources`), wheels/index.json records it per wheel, and the loader refuses a module built
    from other sources than the installed package's."""
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"kind must be 'cpu' or 'cuda', not {kind!r}")
    src = src or source_dir()
    h = hashlib.sha256()
    for path in digest_inputs(kind, src):
        name = "csrc/" + path.relative_to(src).as_posix()
        h.update(name.encode() + b"\0" + path.read_bytes().replace(b"\r\n", b"\n") + b"\0")
    h.update(b"kobold_backend/ops/build.py\0" + Path(__file__).read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return h.hexdigest()


def find_cxx() -> Optional[str]:
    """The C++ compiler: $CXX, else c++, g++ or clang++ on PATH."""
    env = os.environ.get("CXX", "").strip()
    if env:
        return env if shutil.which(env.split()[0]) else None
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def find_nvcc() -> Optional[str]:
    """nvcc from $CUDA_HOME/$CUDA_PATH, PATH, or /usr/local/cuda."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def pybind11_include() -> Optional[str]:
    try:
        import pybind11
    except ImportError:
        return None
    return pybind11.get_include()


def python_include() -> Optional[str]:
    inc = sysconfig.get_paths().get("include")
    return inc if inc and (Path(inc) / "Python.h").is_file() else None


def tool_version(cmd: str) -> str:
    try:
        out = subprocess.run(
            cmd.split() + ["--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    release = [line for line in lines if "release" in line]
    return (release or lines or ["unknown"])[0]


def parse_archs(spec: str) -> List[Tuple[str, bool]]:
    """'8.0 8.6 9.0+PTX' -> [('80', False), ('86', False), ('90', True)] (True: also embed PTX)."""
    archs = []
    for item in spec.replace(";", " ").replace(",", " ").split():
        ptx = item.upper().endswith("+PTX")
        core = item[: -len("+PTX")] if ptx else item
        core = core.lower().replace("sm_", "").replace("compute_", "").replace(".", "")
        if not re.fullmatch(r"\d{2,3}a?", core):
            raise BuildError(f"KOBOLD_BACKEND_CUDA_ARCH entry {item!r} is not like '8.6' or '9.0+PTX'.")
        archs.append((core, ptx))
    if not archs:
        raise BuildError("KOBOLD_BACKEND_CUDA_ARCH is empty.")
    return archs


def gencode_flags(archs: Sequence[Tuple[str, bool]]) -> List[str]:
    flags = []
    for arch, ptx in archs:
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
    return flags


def cuda_arch_spec() -> str:
    return os.environ.get("KOBOLD_BACKEND_CUDA_ARCH", "").strip() or DEFAULT_CUDA_ARCH


def _progress(message: str) -> None:
    sys.stderr.write(f"kobold_backend: {message}\n")
    sys.stderr.flush()


def _run(cmd: List[str], what: str, cwd: Optional[Path] = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=None if cwd is None else str(cwd))
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip()
        raise BuildError(f"{what} failed (exit {proc.returncode}):\n$ {' '.join(cmd)}\n{output}")


def _jobs() -> int:
    env = os.environ.get("MAX_JOBS", "")
    return int(env) if env.isdigit() and int(env) > 0 else max(1, os.cpu_count() or 1)


def _parallel(steps: List[Tuple[List[str], str]], log: Callable[[str], None], cwd: Optional[Path] = None) -> None:
    total = len(steps)

    def one(item: Tuple[int, Tuple[List[str], str]]) -> None:
        index, (cmd, what) = item
        log(f"[{index + 1}/{total}] {what}")
        _run(cmd, what, cwd)

    with ThreadPoolExecutor(max_workers=min(_jobs(), total)) as pool:
        for _ in pool.map(one, enumerate(steps)):
            pass


def cxx_flags(src: Path, version: str) -> List[str]:
    flags = ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-fno-math-errno", f'-DKB_VERSION="{version}"']
    flags += [f"-I{src / 'include'}"]
    if sys.platform != "darwin":
        flags.append("-fopenmp")
    return flags


def _python_flags() -> List[str]:
    missing = [name for name, path in (("Python.h", python_include()), ("pybind11", pybind11_include())) if not path]
    if missing:
        raise BuildError(f"cannot build the extension: {' and '.join(missing)} not found (pip install pybind11; "
                         "install the python3-dev package for Python.h).")
    return [f"-I{python_include()}", f"-I{pybind11_include()}"]


def _sources_define(kind: str) -> str:
    """The binding's -DKB_SOURCES: the module reports the digest of what it was built from (sources_digest)."""
    return f'-DKB_SOURCES="{sources_digest(kind)}"'


def _shared_flags() -> List[str]:
    return ["-shared", "-undefined", "dynamic_lookup"] if sys.platform == "darwin" else ["-shared"]


def _object_key(cmd: Sequence[str], source: Path, tools: Sequence[str]) -> str:
    """What a Python-independent object depends on: its command line (without the output path), the source and
    every header, the compilers' versions and the nvcc flags taken from the environment."""
    h = hashlib.sha256()
    h.update(repr(list(cmd)).encode())
    for f in [source_dir().parent / source] + _headers(source_dir()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    for tool in tools:
        h.update(tool_version(tool).encode())
    for var in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"):
        h.update(os.environ.get(var, "").encode() + b"\0")
    return h.hexdigest()[:16]


def _kernel_steps(cmd: List[str], source: Path, tmp: Path, objects: Optional[Path], tools: Sequence[str],
                  what: str) -> Tuple[List[Tuple[List[str], str]], Path]:
    """The compile step of a source that does not include Python.h, and its object. With `objects` (a folder kept
    by the caller, e.g. tools/build_wheels.py across Pythons) the object is compiled there once under a name keyed
    by _object_key and reused by later builds: the step list is empty when it already exists."""
    if objects is None:
        obj = tmp / (source.stem + ".o")
        return [(cmd + ["-c", str(source), "-o", str(obj)], what)], obj
    obj = objects / f"{source.stem}-{_object_key(cmd, source, tools)}.o"
    if obj.is_file():
        return [], obj
    staged = tmp / obj.name
    return [(cmd + ["-c", str(source), "-o", str(staged)], what)], obj


def _publish(objs: Sequence[Path], tmp: Path) -> None:
    """Move the reusable objects compiled in this build from tmp into their folder (atomic per file)."""
    for obj in objs:
        staged = tmp / obj.name
        if obj.parent != tmp and staged.is_file():
            os.replace(staged, obj)


def build_cpu(out_path: Path, log: Callable[[str], None] = _progress, objects: Optional[Path] = None) -> Path:
    """Compile `_ext_cpu` into out_path (written atomically: a failed build leaves nothing there). `objects`: a
    folder where the kernel objects (every source but the binding, the same for every Python) are kept and
    reused."""
    cxx = find_cxx()
    if not cxx:
        raise BuildError("no C++ compiler found (set CXX or install g++).")
    cwd, src = compile_root()
    flags = cxx_flags(src, package_version()) + [f"-I{src / 'cpu'}"]
    *kernels, binding = cpu_sources(src)
    with tempfile.TemporaryDirectory(prefix=".kb-build-", dir=str(out_path.parent)) as tmp:
        steps: List[Tuple[List[str], str]] = []
        kernel_objs: List[Path] = []
        for source in kernels:
            kernel_steps, obj = _kernel_steps(cxx.split() + flags, source, Path(tmp), objects, [cxx],
                                              f"compile {source.name}")
            steps += kernel_steps
            kernel_objs.append(obj)
        binding_obj = Path(tmp) / (binding.stem + ".o")
        steps.append((cxx.split() + flags + _python_flags() + [_sources_define("cpu"), "-c", str(binding), "-o",
                                                                 str(binding_obj)],
                      f"compile {binding.name}"))
        _parallel(steps, log, cwd)
        objs = kernel_objs + [binding_obj]
        _publish(objs, Path(tmp))
        staged = Path(tmp) / out_path.name
        log(f"link {out_path.name}")
        link = cxx.split() + _shared_flags() + [str(o) for o in objs] + ["-o", str(staged)]
        if sys.platform != "darwin":
            link.append("-fopenmp")
        _run(link, f"link {out_path.name}")
        os.replace(staged, out_path)
    return out_path


def nvcc_flags(src: Path, version: str, archs: Sequence[Tuple[str, bool]]) -> List[str]:
    arch_text = " ".join(f"{a}{'+PTX' if p else ''}" for a, p in archs)
    return [
        "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
        f"-I{src / 'include'}", f"-I{src / 'cuda'}", f'-DKB_VERSION="{version}"', f'-DKB_CUDA_ARCHS="{arch_text}"',
    ] + gencode_flags(archs)


def _cuda_compile_steps(src: Path, tmp: Path, archs: Sequence[Tuple[str, bool]], nvcc: str, cxx: str,
                        objects: Optional[Path] = None) -> Tuple[List[Tuple[List[str], str]], List[Path]]:
    version = package_version()
    steps: List[Tuple[List[str], str]] = []
    objs: List[Path] = []
    for s in cuda_sources(src):
        kernel_steps, obj = _kernel_steps([nvcc] + nvcc_flags(src, version, archs), s, tmp, objects, [nvcc, cxx],
                                          f"nvcc {s.name}")
        steps += kernel_steps
        objs.append(obj)
    binding = cuda_binding_source(src)
    obj = tmp / (binding.stem + ".o")
    flags = cxx_flags(src, version) + [f"-I{src / 'cuda'}"] + _python_flags() + [_sources_define("cuda")]
    steps.append((cxx.split() + flags + ["-c", str(binding), "-o", str(obj)], f"compile {binding.name}"))
    objs.append(obj)
    return steps, objs


def build_cuda(out_path: Path, arch_spec: Optional[str] = None, log: Callable[[str], None] = _progress,
               objects: Optional[Path] = None) -> Path:
    """Compile `_ext_cuda` (cudart linked statically) into out_path atomically. `objects`: a folder where the
    kernel objects (the .cu files, the same for every Python) are kept and reused; only the binding is per Python."""
    nvcc, cxx = find_nvcc(), find_cxx()
    if not nvcc:
        raise BuildError("nvcc not found (set CUDA_HOME or put the CUDA toolkit's bin/ on PATH).")
    if not cxx:
        raise BuildError("no C++ compiler found (set CXX or install g++).")
    cwd, src = compile_root()
    archs = parse_archs(arch_spec or cuda_arch_spec())
    with tempfile.TemporaryDirectory(prefix=".kb-build-", dir=str(out_path.parent)) as tmp:
        steps, objs = _cuda_compile_steps(src, Path(tmp), archs, nvcc, cxx, objects)
        _parallel(steps, log, cwd)
        _publish(objs, Path(tmp))
        staged = Path(tmp) / out_path.name
        log(f"link {out_path.name} (cudart static)")
        _run([nvcc, "-shared", "-cudart=static"] + gencode_flags(archs) + [str(o) for o in objs] + ["-o", str(staged)],
             f"link {out_path.name}")
        os.replace(staged, out_path)
    return out_path


def check_cuda(arch_spec: Optional[str] = None, log: Callable[[str], None] = _progress) -> None:
    """Compile every CUDA source and the binding to objects (no link); raises BuildError on the first error."""
    nvcc, cxx = find_nvcc(), find_cxx()
    if not nvcc or not cxx:
        raise BuildError("nvcc and a C++ compiler are needed for the CUDA compile check.")
    archs = parse_archs(arch_spec or cuda_arch_spec())
    with tempfile.TemporaryDirectory(prefix="kb-cuda-check-") as tmp:
        cwd, src = compile_root()
        steps, _ = _cuda_compile_steps(src, Path(tmp), archs, nvcc, cxx)
        _parallel(steps, log, cwd)


def jit_key(kind: str) -> str:
    """Hash of everything the compiled module depends on: sources, flags, compilers, Python, package version."""
    src = source_dir()
    files = cpu_sources(src) if kind == "cpu" else cuda_sources(src) + [cuda_binding_source(src)]
    h = hashlib.sha256()
    for f in sorted(set(files + _headers(src))):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    parts: Dict[str, str] = {
        "kind": kind,
        "sources": sources_digest(kind, src),
        "version": package_version(),
        "python": sys.version,
        "suffix": ext_suffix(),
        "cxx": tool_version(find_cxx() or "c++"),
    }
    if kind == "cuda":
        parts["nvcc"] = tool_version(find_nvcc() or "nvcc")
        parts["archs"] = cuda_arch_spec()
    h.update(repr(sorted(parts.items())).encode())
    return h.hexdigest()[:20]


def _inplace_path(name: str) -> Path:
    return _PACKAGE_DIR / f"{name}{ext_suffix()}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kobold_backend.ops.build", description=__doc__)
    parser.add_argument("--check-cuda", action="store_true", help="compile every CUDA source to an object")
    parser.add_argument("--cpu", action="store_true", help="build kobold_backend/_ext_cpu in place")
    parser.add_argument("--cuda", action="store_true", help="build kobold_backend/_ext_cuda in place")
    parser.add_argument("--arch", default=None, help=f"CUDA archs (default $KOBOLD_BACKEND_CUDA_ARCH or "
                                                     f"'{DEFAULT_CUDA_ARCH}')")
    args = parser.parse_args(argv)
    if not (args.check_cuda or args.cpu or args.cuda):
        parser.error("give --check-cuda, --cpu and/or --cuda")
    try:
        if args.check_cuda:
            check_cuda(args.arch)
            _progress("CUDA compile check passed")
        if args.cpu:
            _progress(f"built {build_cpu(_inplace_path(CPU_MODULE))}")
        if args.cuda:
            _progress(f"built {build_cuda(_inplace_path(CUDA_MODULE), args.arch)}")
    except BuildError as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
