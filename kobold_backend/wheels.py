"""Prebuilt kernel wheels: reads wheels/index.json, picks the wheel that fits a Python environment (probed by running
that Python), verifies its sha256 and installs it with pip; `kobold-backend install-ext` and the doctor's wheel line.

The wheels (distribution and package `kobold_backend_ext`, made by tools/build_wheels.py) hold only the native
modules, which kobold_backend/ops/native.py imports when none is built into the kobold_backend package itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import kobold_backend
from kobold_backend.errors import KoboldBackendError

DIST_NAME = "kobold_backend_ext"
PACKAGE = "kobold_backend_ext"
INDEX_FORMAT = 1
ENV_INDEX = "KOBOLD_BACKEND_WHEELS"
FINGERPRINTS_FILE = "fingerprints.json"
# The modules never link libtorch, so one wheel serves every torch this package supports (pyproject's floor).
TORCH_RANGE = ">=2.1"
# ... and they link cudart statically, so a CUDA wheel runs beside any torch CUDA build: only the driver has to be
# new enough for the toolkit the wheel was built with. The torch CUDA majors every CUDA wheel serves:
TORCH_CUDA_MAJORS = (11, 12, 13)
# The oldest driver a module built with each toolkit runs under (docs/wheels.md, "Drivers", cites NVIDIA's tables):
# the CUDA version that driver reports, and its Linux driver number. CUDA 11.x runtimes run on any 11.x driver from
# 450.80.02 on (minor version compatibility; PTX JIT excepted, which only GPUs newer than sm_90 need, and their
# drivers are new); 13.0 is the first of its major, so its own driver.
DRIVER_MIN = {"11.8": ("11.0", "450.80.02"), "13.0": ("13.0", "580.65.06")}

Say = Callable[[str], None]

JIT_HINT = (
    "The engine then compiles its kernels on first use (JIT from its csrc/: needs g++ and, for the GPU kernels, "
    "a CUDA toolkit's nvcc found through CUDA_HOME or PATH; cached under ~/.cache/kobold_backend/ext) and "
    "otherwise runs its torch reference ops; `kobold-backend doctor` shows which path serves each device, and "
    "docs/wheels.md says how to build a wheel for this environment."
)


class WheelError(KoboldBackendError):
    """The wheel index is unreadable, a wheel is missing or fails its sha256, or pip/the installed module failed."""


# ---------------------------------------------------------------------------------------------- index and files


def default_index_path() -> Path:
    """$KOBOLD_BACKEND_WHEELS (index.json or its folder), else wheels/index.json next to this source checkout."""
    env = os.environ.get(ENV_INDEX, "").strip()
    if env:
        path = Path(env)
        return path if path.suffix == ".json" else path / "index.json"
    return Path(kobold_backend.__file__).resolve().parent.parent / "wheels" / "index.json"


def empty_index() -> Dict[str, Any]:
    return {"format": INDEX_FORMAT, "distribution": DIST_NAME, "entries": []}


def load_index(path: Path) -> Dict[str, Any]:
    try:
        index = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WheelError(f"The wheel index {path} cannot be read ({exc}).") from exc
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT or not isinstance(index.get("entries"), list):
        raise WheelError(f"The wheel index {path} is not a format-{INDEX_FORMAT} index (see wheels/index.schema.json).")
    return index


def entry_sort_key(entry: Dict[str, Any]) -> Any:
    return (entry["variant"] != "cpu", entry["variant"], [int(x) for x in entry["python"].split(".")])


def write_index(path: Path, index: Dict[str, Any]) -> None:
    tmp = Path(path).with_name(Path(path).name + ".part")
    tmp.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def filename_tags(filename: str) -> List[str]:
    """The compatibility tags a wheel's file name declares ('cp312-cp312-manylinux_2_34_x86_64', ...)."""
    parts = filename[: -len(".whl")].split("-")
    if not filename.endswith(".whl") or len(parts) not in (5, 6):
        raise WheelError(f"{filename} is not a wheel file name")
    py, abi, plat = parts[-3:]
    return [f"{p}-{a}-{x}" for p in py.split(".") for a in abi.split(".") for x in plat.split(".")]


def read_wheel(path: Path) -> Dict[str, Any]:
    """Name, version and tags from a wheel's metadata, its embedded module fingerprints, and its file list."""
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        dist_info = sorted({n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")})
        if len(dist_info) != 1:
            raise WheelError(f"{path} has {len(dist_info)} .dist-info folders")
        meta = zf.read(f"{dist_info[0]}/METADATA").decode()
        wheel = zf.read(f"{dist_info[0]}/WHEEL").decode()
        fingerprints = json.loads(zf.read(f"{PACKAGE}/{FINGERPRINTS_FILE}"))
    field_of = {}
    for line in meta.splitlines():
        key, _, value = line.partition(": ")
        field_of.setdefault(key, value)
    tags = [line.split(": ", 1)[1] for line in wheel.splitlines() if line.startswith("Tag: ")]
    return {"name": field_of.get("Name"), "version": field_of.get("Version"), "tags": tags,
            "fingerprints": fingerprints, "files": names}


# ---------------------------------------------------------------------------------------------- the environment

SCRIPTS = Path(__file__).resolve().parent / "scripts"  # programs run by path in the target Python


def probe(python: str) -> Dict[str, Any]:
    """Run scripts/probe_env.py with `python` (from a neutral folder, so no local package shadows the installed
    ones)."""
    with tempfile.TemporaryDirectory(prefix="kb-probe-") as cwd:
        try:
            proc = subprocess.run([str(python), str(SCRIPTS / "probe_env.py")], capture_output=True, text=True,
                                  cwd=cwd, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            raise WheelError(f"Cannot run {python} to inspect its environment ({exc}).") from exc
    lines = [line for line in proc.stdout.splitlines() if line.startswith("KOBOLD_BACKEND_PROBE ")]
    if proc.returncode != 0 or not lines:
        raise WheelError(f"Inspecting {python} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return json.loads(lines[-1].split(" ", 1)[1])


def probe_here() -> Dict[str, Any]:
    """The probe run in this interpreter (what `probe(sys.executable)` would report, without a process)."""
    from kobold_backend.scripts.probe_env import probe as probe_this_python

    return probe_this_python()


# ---------------------------------------------------------------------------------------------- selection


@dataclass
class Decision:
    """The wheel chosen for one environment ("cuda": CUDA and CPU modules, "cpu": CPU module only) or none,
    with the reasons other wheels were passed over."""

    env: Dict[str, Any]
    entry: Optional[Dict[str, Any]] = None
    kind: str = "none"
    reasons: List[str] = field(default_factory=list)
    installed: bool = False

    def describe_env(self) -> str:
        env = self.env
        torch = env.get("torch")
        if torch:
            torch += f" (CUDA {env['torch_cuda']})" if env.get("torch_cuda") else \
                f" (ROCm {env['torch_hip']})" if env.get("torch_hip") else " (CPU-only)"
        driver = env.get("driver_cuda")
        parts = [f"Python {env.get('python')} on {env.get('platform')}", f"torch {torch or 'not installed'}",
                 f"NVIDIA driver for CUDA {driver // 1000}.{driver % 1000 // 10}" if driver else "no NVIDIA driver"]
        return ", ".join(parts)

    def message(self) -> str:
        """One message: what will be installed for which environment, or why nothing fits and what happens then."""
        why = f" ({'; '.join(self.reasons)})" if self.reasons else ""
        if self.entry is None:
            return f"No prebuilt kernel wheel fits {self.describe_env()}{why}. {JIT_HINT}"
        wheel = self.entry["wheel"]
        if self.kind == "cuda":
            return (f"Prebuilt kernels for {self.describe_env()}: {wheel} (CPU and CUDA {self.entry['cuda']} "
                    f"modules, sm {' '.join(self.entry['archs'])}){why}.")
        if self.env.get("torch_cuda") or self.env.get("torch_hip"):
            return (f"Prebuilt kernels for {self.describe_env()}: {wheel} holds the CPU module only; no CUDA wheel "
                    f"fits{why}. For the GPU kernels: {JIT_HINT}")
        return f"Prebuilt kernels for {self.describe_env()}: {wheel} (CPU module; this torch has no CUDA)."


def _version_tuple(text: str) -> List[int]:
    return [int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3]]


def torch_in_range(spec: str, version: str) -> bool:
    """Whether torch `version` (local part like +cu118 ignored) satisfies `spec` (packaging's specifiers)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        public = Version(version).public
    except InvalidVersion:
        public = ".".join(str(x) for x in _version_tuple(version))
    return SpecifierSet(spec).contains(public, prereleases=True)


def cuda_number(version: str) -> int:
    """'11.8' -> 11080, the form cuDriverGetVersion reports (1000 * major + 10 * minor)."""
    major, minor = (int(x) for x in version.split(".")[:2])
    return major * 1000 + minor * 10


def driver_min(cuda: str) -> Dict[str, str]:
    """The index's `driver_min` of a wheel built with CUDA `cuda`: the CUDA version its driver must support and the
    Linux driver that first did (for a toolkit missing from DRIVER_MIN: the toolkit's own version, no number)."""
    reported, linux = DRIVER_MIN.get(cuda, (cuda, ""))
    return {"cuda": reported, "linux": linux}


def _cuda_problem(entry: Dict[str, Any], env: Dict[str, Any]) -> Optional[str]:
    """Why this CUDA wheel cannot serve the environment's driver or GPUs, or None."""
    from kobold_backend.ops.native import arch_supported

    need = entry["driver_min"]
    driver = env.get("driver_cuda")
    if not driver:
        return f"{entry['wheel']} needs an NVIDIA driver and none was found"
    if driver < cuda_number(need["cuda"]):
        number = f" (Linux driver >= {need['linux']})" if need.get("linux") else ""
        return (f"{entry['wheel']} needs a driver for CUDA {need['cuda']}{number} but this driver supports CUDA "
                f"{driver // 1000}.{driver % 1000 // 10}")
    for name, cap in env.get("gpus") or []:
        if not arch_supported(tuple(cap), entry["archs"]):
            held = " ".join(entry["archs"])
            return f"{entry['wheel']} has no code for {name} (sm_{cap[0]}{cap[1]}; it holds sm {held})"
    return None


def select(env: Dict[str, Any], entries: Sequence[Dict[str, Any]], version: str = kobold_backend.__version__
           ) -> Decision:
    """The wheel for `env` (a probe result): the CUDA wheel of the newest toolkit that serves torch's CUDA major and
    that the driver and every visible GPU can run (whatever CUDA torch was built with: the modules link cudart
    statically), else the CPU wheel, else none. Every entry must be for kobold_backend `version`, accept the
    environment's torch and carry a tag the environment's pip accepts."""
    decision = Decision(env=env)
    torch = env.get("torch")
    if not torch:
        decision.reasons.append(f"torch is not importable there ({env.get('torch_error') or 'not installed'}); "
                                f"install torch{TORCH_RANGE} in it first")
        return decision
    same = [e for e in entries if e["version"] == version]
    if not same:
        decision.reasons.append(f"the index has no wheels for kobold_backend {version}")
        return decision
    tags = set(env.get("tags") or [])
    fit = [e for e in same if tags.intersection(e["tags"])]
    if not fit:
        covered = sorted({f"cp{e['python'].replace('.', '')} {e['platform']}" for e in same})
        decision.reasons.append(f"no wheel is for this Python and platform; the index covers {', '.join(covered)}")
        return decision
    in_range = [e for e in fit if torch_in_range(e["torch"], torch)]
    if not in_range:
        decision.reasons.append(f"torch {torch} is outside {', '.join(sorted({e['torch'] for e in fit}))}")
        return decision
    torch_cuda = env.get("torch_cuda")
    if torch_cuda:
        major = int(str(torch_cuda).split(".")[0])
        cuda = [e for e in in_range if e.get("cuda") and major in e.get("torch_cuda_majors", [])]
        if not cuda:
            have = sorted({e["variant"] for e in in_range if e.get("cuda")}) or ["none"]
            decision.reasons.append(f"no CUDA wheel for torch built with CUDA {major}.x and this Python "
                                    f"(CUDA wheels here: {', '.join(have)})")
        for entry in sorted(cuda, key=lambda e: _version_tuple(e["cuda"]), reverse=True):
            problem = _cuda_problem(entry, env)
            if problem is None:
                decision.entry, decision.kind = entry, "cuda"
                return decision
            decision.reasons.append(problem)
    elif env.get("torch_hip"):
        decision.reasons.append("there are no ROCm wheels")
    cpu = [e for e in in_range if not e.get("cuda")]
    if cpu:
        decision.entry, decision.kind = cpu[0], "cpu"
    return decision


# ---------------------------------------------------------------------------------------------- install


def verify_file(wheel: Path, entry: Dict[str, Any]) -> None:
    if not wheel.is_file():
        raise WheelError(f"The index lists {wheel.name} but {wheel} does not exist.")
    digest = sha256_file(wheel)
    if digest != entry["sha256"]:
        raise WheelError(f"{wheel} has sha256 {digest} but the index says {entry['sha256']}; refusing to install it "
                         f"(rebuild it with tools/build_wheels.py or restore the file).")


def _run(python: str, args: Sequence[str], cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *args], capture_output=True, text=True, cwd=cwd)


def check_installed(python: str, entry: Dict[str, Any]) -> List[str]:
    """Import the installed modules with `python`; the problems found (empty: each fingerprint matches the index)."""
    with tempfile.TemporaryDirectory(prefix="kb-check-") as cwd:
        proc = _run(python, [str(SCRIPTS / "ext_check.py"), *sorted(entry["modules"])], cwd)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("KOBOLD_BACKEND_EXT_CHECK ")]
    if not lines:
        return [f"the import check failed to run: {proc.stderr.strip()}"]
    found = json.loads(lines[-1].split(" ", 1)[1])
    problems = []
    for name, expected in sorted(entry["modules"].items()):
        got = found.get(name, {})
        if "error" in got:
            problems.append(f"{PACKAGE}.{name} does not import ({got['error']})")
        elif got.get("fingerprint") != expected:
            problems.append(f"{PACKAGE}.{name} reports {got.get('fingerprint')} instead of {expected}")
    return problems


def install_ext(python: str = sys.executable, say: Say = print, dry_run: bool = False,
                index_path: Optional[Path] = None) -> Decision:
    """Install the wheel that fits `python`'s environment (what install-plugin calls). No fitting wheel is not an
    error: the message says so and how the kernels are served instead. Raises WheelError when the index is
    unreadable, the wheel fails its sha256, pip fails, or the installed modules do not import as indexed (then
    the wheel is uninstalled again)."""
    env = probe(python)
    path = Path(index_path) if index_path else default_index_path()
    if not path.is_file():
        decision = Decision(env=env, reasons=[f"no wheel index at {path}; set {ENV_INDEX} to a wheels/ folder"])
        say(decision.message())
        return decision
    decision = select(env, load_index(path)["entries"])
    say(decision.message())
    if decision.entry is None or dry_run:
        return decision
    wheel = path.parent / decision.entry["wheel"]
    verify_file(wheel, decision.entry)
    say(f"Installing {wheel.name} (sha256 verified) into {python} with pip --no-deps")
    with tempfile.TemporaryDirectory(prefix="kb-pip-") as cwd:
        proc = _run(python, ["-m", "pip", "--disable-pip-version-check", "--no-input", "install", "--no-deps",
                             "--no-index", "--force-reinstall", str(wheel)], cwd)
        if proc.returncode != 0:
            raise WheelError(f"pip could not install {wheel.name} into {python}:\n{proc.stdout}{proc.stderr}")
        problems = check_installed(python, decision.entry)
        if problems:
            _run(python, ["-m", "pip", "--disable-pip-version-check", "uninstall", "-y", DIST_NAME], cwd)
            raise WheelError(f"{wheel.name} was installed but {'; '.join(problems)}; it was uninstalled again. "
                             f"{JIT_HINT}")
    decision.installed = True
    say(f"Installed {DIST_NAME} {decision.entry['version']}+{decision.entry['variant']}; its modules import and "
        "match the index.")
    return decision


# ---------------------------------------------------------------------------------------------- CLI


def add_install_ext_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "install-ext", help="install the prebuilt kernel wheel that fits a Python environment",
        description="Probe a Python environment (Python, platform, torch and its CUDA, NVIDIA driver, GPUs), pick "
                    "the fitting wheel from wheels/index.json, verify its sha256 and pip-install it (--no-deps); "
                    "when none fits, say how the kernels are served instead.",
    )
    p.add_argument("--python", default=sys.executable, help="the target Python (default: this one)")
    p.add_argument("--dry-run", action="store_true", help="only print the decision")
    p.add_argument("--index", type=Path, default=None,
                   help=f"the wheel index (default: ${ENV_INDEX} or wheels/index.json of this checkout)")
    return p


def run_install_ext(args: argparse.Namespace) -> int:
    install_ext(args.python, say=print, dry_run=args.dry_run, index_path=args.index)
    return 0
