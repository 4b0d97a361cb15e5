"""The native-kernel step of scripts/setup.sh, run by the environment's own Python from the checkout.

The kernels come from the committed prebuilt wheel that fits (kobold_backend.wheels' selection, what
`kobold-backend install-ext` installs) when it was built from this checkout's csrc/ and build.py; otherwise they are
compiled in place with kobold_backend/ops/build.py, provided a C++ compiler exists. A wheel built from other sources
is still installed when nothing here can compile them. With neither a wheel nor a compiler the script says in one
sentence what to install and exits 1.

    python scripts/setup_kernels.py --check   before torch is installed: fail early when neither can work
    python scripts/setup_kernels.py           install or build the kernels, then report which path serves them
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kobold_backend import wheels  # noqa: E402 (the checkout is put on sys.path first; no torch import)


def _load(name: str, path: Path) -> Any:
    """A module loaded by path: kobold_backend.ops imports torch, which the pre-torch check cannot."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load("kb_build", ROOT / "kobold_backend" / "ops" / "build.py")  # standard library only

# What the pre-torch check assumes: setup.sh installs a torch in pyproject's range, and every range admits its floor.
TORCH_FLOOR = "2.1.0"
COMPILER_HINT = "install one (Debian/Ubuntu: apt-get install g++; Fedora: dnf install gcc-c++) or point CXX at one"


def say(message: str) -> None:
    sys.stderr.write(f"setup: {message}\n")
    sys.stderr.flush()


def sources_digest(kind: str) -> str:
    """The digest tools/build_wheels.py records per wheel (`sources`) for a module kind, from this checkout."""
    return build.sources_digest(kind, ROOT / "csrc")


def decide(env: Dict[str, Any], entries: Any, cxx: Optional[str], nvcc: Optional[str],
           digests: Dict[str, str]) -> Tuple[str, str]:
    """("wheel" | "source" | "none", why) for a probed environment; `nvcc` only when the CUDA module is wanted."""
    decision = wheels.select(env, entries)
    entry = decision.entry
    if entry is not None:
        if entry.get("sources") == digests["cuda" if entry.get("cuda") else "cpu"]:
            return "wheel", ""
        stale = (f"the kernel wheel for this environment, {entry['wheel']}, was built from other sources than this "
                 "checkout's csrc/ and build.py")
        if cxx:
            return "source", f"{stale}, so the kernels are compiled here with {cxx}"
        return "none", (f"{stale} (the loader would refuse it) and there is no C++ compiler to build the kernels: "
                        f"{COMPILER_HINT}, or restore csrc/ to the committed sources, then run setup again.")
    where = f"Python {env.get('python')} on {env.get('platform')}"
    reasons = "; ".join(decision.reasons) or "no entry matches"
    if cxx:
        return "source", f"no prebuilt kernel wheel fits {where} ({reasons}), so the kernels are compiled here " \
                         f"with {cxx}"
    env_cxx = os.environ.get("CXX", "").strip()
    missing = f"CXX={env_cxx!r} is not runnable" if env_cxx else "no c++, g++ or clang++ is on PATH"
    return "none", (f"no prebuilt kernel wheel fits {where} ({reasons}) and there is no C++ compiler to build the "
                    f"kernels ({missing}): {COMPILER_HINT}, then run setup again.")


def build_wanted() -> Tuple[bool, Optional[str]]:
    """Whether a source build includes the CUDA module (a GPU is present and nvcc found), and that nvcc."""
    nvcc = build.find_nvcc()
    if os.environ.get("KOBOLD_BACKEND_NO_CUDA", "") == "1" or shutil.which("nvidia-smi") is None:
        return False, nvcc
    return nvcc is not None, nvcc


def remove_inplace_modules() -> None:
    """Modules an earlier source build left in the package shadow a wheel's (the loader tries the package first)."""
    for kind in ("cpu", "cuda"):
        path = ROOT / "kobold_backend" / f"_ext_{kind}{build.ext_suffix()}"
        if path.exists():
            say(f"removing {path.relative_to(ROOT)} from an earlier source build (the wheel's module replaces it)")
            path.unlink()


def uninstall_wheel(env: Dict[str, Any]) -> None:
    if env.get("installed_ext"):
        say(f"uninstalling {wheels.DIST_NAME} {env['installed_ext']} (the modules built here replace it)")
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", wheels.DIST_NAME], check=True)


def compile_here(with_cuda: bool) -> None:
    """Build the modules in place (as `pip install -e .` would), keeping any that is newer than every source."""
    sources = [p for p in (ROOT / "csrc").rglob("*") if p.is_file()] + [ROOT / "kobold_backend" / "ops" / "build.py"]
    newest = max(p.stat().st_mtime for p in sources)
    for name, builder in ((build.CPU_MODULE, build.build_cpu), (build.CUDA_MODULE, build.build_cuda)):
        if name == build.CUDA_MODULE and not with_cuda:
            continue
        path = ROOT / "kobold_backend" / f"{name}{build.ext_suffix()}"
        if path.is_file() and path.stat().st_mtime > newest:
            say(f"keeping {path.relative_to(ROOT)}: it is newer than every file in csrc/ and build.py")
            continue
        builder(path, log=say)


def report() -> None:
    """Which path serves CPU and CUDA tensors now, checked in a fresh interpreter of this environment."""
    code = ("from kobold_backend.doctor import in_use_line\n"
            "from kobold_backend.ops import native\n"
            "status = native.status()\n"
            "for kind in ('cpu', 'cuda'):\n"
            "    e = status[kind]\n"
            "    why = '' if e['path'] != 'torch' else ' (%s)' % e['reason']\n"
            "    print('%s kernels: %s%s' % (kind.upper(), in_use_line(e).strip()[len('in use: '):], why))\n")
    env = dict(os.environ, KOBOLD_BACKEND_EXT="prebuilt")  # report what is installed; never start a JIT build
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), env=env)
    for line in (proc.stdout + proc.stderr).splitlines():
        say(line)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that a wheel fits or a compiler exists")
    args = parser.parse_args(argv)
    try:
        env = wheels.probe(sys.executable)
        if args.check and not env.get("torch"):
            env = dict(env, torch=TORCH_FLOOR, torch_cuda=None, torch_hip=None)
        index_path = wheels.default_index_path()
        entries = wheels.load_index(index_path)["entries"] if index_path.is_file() else []
        with_cuda, nvcc = build_wanted()
        path, why = decide(env, entries, build.find_cxx(), nvcc if with_cuda else None,
                           {kind: sources_digest(kind) for kind in ("cpu", "cuda")})
        if path == "none":
            say(why)
            return 1
        if args.check:
            return 0
        if why:
            say(why)
        if path == "wheel":
            remove_inplace_modules()
            wheels.install_ext(sys.executable, say=say, index_path=index_path)
        else:
            uninstall_wheel(env)
            compile_here(with_cuda)
    except (wheels.WheelError, build.BuildError, subprocess.CalledProcessError) as exc:
        say(str(exc))
        return 1
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
