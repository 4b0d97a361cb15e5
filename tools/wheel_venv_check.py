"""For each Python (default 3.8-3.13): a fresh venv under $TMPDIR with a real torch from the package index,
`kobold-backend install-ext` into it from this checkout's wheels/ (it must pick that Python's CPU wheel), then, in
that venv, the loader imports kobold_backend_ext._ext_cpu (the prebuilt path, with any module built into the
checkout hidden) and runs rms_norm against the torch reference. One line per Python; exit status 1 if any failed.

    python tools/wheel_venv_check.py [--python 3.8 ...] [--torch 3.13=torch==2.6.0] [--keep]

torch is pinned per Python (TORCH_FOR) so one set of its CUDA runtime packages serves every venv but 3.8's (pip's
cache holds them; a CPU machine still needs them to import torch). Each venv is deleted after its check (about
4 GB each) unless --keep.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from build_wheels import DEFAULT_PYTHONS, BuildFailed, find_python  # noqa: E402 (tools/ is put on sys.path first)

from kobold_backend import wheels  # noqa: E402

# torch 2.4.1 is the last release for Python 3.8; 2.5.1 is the oldest with a Python 3.13 build, and serves 3.9-3.12.
TORCH_FOR: Dict[str, str] = {"3.8": "torch==2.4.1"}
TORCH_DEFAULT = "torch==2.5.1"

# Runs in the venv, from the checkout (so `kobold_backend` is this source tree): the prebuilt path must serve.
LOADER_SCRIPT = r"""
import sys, torch
sys.modules["kobold_backend._ext_cpu"] = None  # a module built into the checkout must not serve
from kobold_backend.ops import native, reference
r = native.load("cpu", mode="prebuilt")
x = torch.randn(3, 40, dtype=torch.float64).float(); w = torch.rand(40) + 0.5
y = native.CpuKernels(r.module).rms_norm(x, w, 1e-5)
torch.testing.assert_close(y, reference.rms_norm(x.double(), w.double(), 1e-5).float())
print("LOADER", r.path, r.module.__name__, r.file, torch.__version__)
"""


def run(cmd: Sequence[str], cwd: Optional[Path] = None, timeout: int = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def check(spec: str, torch_spec: str, keep: bool) -> str:
    """One Python: the result line ('ok ...' or 'FAILED ...')."""
    base = find_python(spec)
    root = Path(tempfile.mkdtemp(prefix=f"kb-venv-{spec}-"))
    try:
        started = time.monotonic()
        proc = run([base, "-m", "venv", root])
        if proc.returncode != 0:
            return f"FAILED venv: {proc.stderr.strip()}"
        python = root / "bin" / "python"
        proc = run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", torch_spec])
        if proc.returncode != 0:
            return f"FAILED pip install {torch_spec}: {proc.stderr.strip()[-800:]}"
        said: List[str] = []
        decision = wheels.install_ext(str(python), say=said.append)
        chosen = decision.entry["wheel"] if decision.entry else None
        if not decision.installed or decision.kind != "cpu":
            return f"FAILED install-ext chose {chosen} ({decision.kind}): {' | '.join(said)}"
        with tempfile.TemporaryDirectory(prefix="kb-cwd-") as cwd:
            proc = run([python, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + LOADER_SCRIPT],
                       cwd=Path(cwd), timeout=600)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("LOADER ")]
        if proc.returncode != 0 or not lines:
            return f"FAILED loader: {proc.stderr.strip()[-800:]}"
        _, path, module, file, torch_version = lines[-1].split()
        if path != "prebuilt" or module != "kobold_backend_ext._ext_cpu" or not file.startswith(str(root)):
            return f"FAILED loader used {path} {module} {file}"
        return (f"ok: torch {torch_version}, install-ext chose {chosen}; the loader ran rms_norm from {file} "
                f"({time.monotonic() - started:.0f} s)")
    finally:
        if keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/wheel_venv_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", action="append", default=None, help="version or path (repeatable)")
    parser.add_argument("--torch", action="append", default=[], metavar="PY=SPEC",
                        help="the torch requirement for one Python, e.g. 3.13=torch==2.6.0")
    parser.add_argument("--keep", action="store_true", help="keep the venvs")
    args = parser.parse_args(argv)
    torch_for = dict(TORCH_FOR)
    for item in args.torch:
        py, _, spec = item.partition("=")
        torch_for[py] = spec
    failed = 0
    for spec in args.python or list(DEFAULT_PYTHONS):
        try:
            line = check(spec, torch_for.get(spec, TORCH_DEFAULT), args.keep)
        except (BuildFailed, wheels.WheelError, OSError, subprocess.SubprocessError) as exc:
            line = f"FAILED {exc}"
        failed += line.startswith("FAILED")
        print(f"Python {spec}: {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
