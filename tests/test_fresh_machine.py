"""What a fresh machine sees: the README's setup in a new environment with no C++ compiler takes its kernels from the
committed wheel; with neither a wheel nor a compiler it stops with one sentence before downloading torch; the wheel
builder works with an empty temporary folder; and this suite keeps its caches in its own folder (conftest.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import venv
from pathlib import Path
from typing import Any, Dict, List

import pytest

from kobold_backend import demo, wheels
from kobold_backend.ops import native

ROOT = Path(__file__).resolve().parent.parent
OURS = re.compile(r"kobold[_-]backend|__editable__", re.IGNORECASE)
TOOLS = ("bash", "dirname", "awk")  # every program scripts/setup.sh runs besides the environment's Python
HERE = f"{sys.version_info[0]}.{sys.version_info[1]}"
BUILD_TOOLS = re.compile(r"(_distutils_hack|pip|setuptools|pkg_resources|wheel|pybind11|packaging)\b", re.IGNORECASE)


def copy_checkout(dest: Path) -> None:
    """The files git knows here (committed or not, ignored ones left out): what a fresh clone would hold."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def new_environment(folder: Path, keep: re.Pattern[str] = re.compile(".")) -> Path:
    """folder/.venv, a new environment of this Python that sees this environment's packages whose names match `keep`
    (never kobold_backend) through a .pth file naming a mirror of site-packages, so nothing is downloaded."""
    venv.EnvBuilder(with_pip=False).create(folder / ".venv")
    mirror = folder.parent / f"{folder.name}-site-packages"
    mirror.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if keep.match(entry.name) and not OURS.search(entry.name) and entry.suffix != ".pth":
            (mirror / entry.name).symlink_to(entry)
    python = folder / ".venv" / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "parent_env.pth").write_text(f"{mirror}\n")
    return python


def no_compiler_env(tmp: Path, **extra: str) -> Dict[str, str]:
    """The environment of a machine without a C++ compiler or a package index: CXX names nothing, PATH holds only
    the programs setup.sh needs, and pip reads no configuration and may not download."""
    bin_dir = tmp / "bin"
    if not bin_dir.is_dir():
        bin_dir.mkdir()
        for tool in TOOLS:
            found = shutil.which(tool)
            assert found, f"{tool} is needed to run scripts/setup.sh"
            (bin_dir / tool).symlink_to(found)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "KOBOLD_BACKEND_", "PYTHON", "CUDA_")) and k != "CXX"}
    env.update(PATH=str(bin_dir), CXX="/nonexistent/c++", PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull,
               PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to copy")
    tmp = tmp_path_factory.mktemp("fresh-machine")
    checkout = tmp / "kobold-backend"
    checkout.mkdir()
    copy_checkout(checkout)
    return {"tmp": tmp, "checkout": checkout, "python": new_environment(checkout)}


def setup_sh(fresh: Dict[str, Any], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=str(fresh["checkout"]), capture_output=True, text=True,
                          env=no_compiler_env(fresh["tmp"], **extra), timeout=900)


@pytest.mark.slow
def test_setup_without_compiler_or_wheel_says_what_to_install(fresh: Dict[str, Any]) -> None:
    empty = fresh["tmp"] / "no-wheels"
    empty.mkdir()
    (empty / "index.json").write_text(json.dumps(wheels.empty_index()))
    proc = setup_sh(fresh, KOBOLD_BACKEND_WHEELS=str(empty))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr.lower()
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("setup: no prebuilt kernel wheel fits Python "), proc.stderr
    assert "the index has no wheels for kobold_backend" in last and "CXX='/nonexistent/c++' is not runnable" in last
    assert "apt-get install g++" in last and last.count(". ") == 0 and last.endswith("then run setup again.")
    assert "installing torch" not in proc.stderr  # it stops before the large download
    assert not list((fresh["checkout"] / ".venv").rglob("kobold_backend*.dist-info"))


@pytest.mark.slow
@pytest.mark.skipif(not any(e["python"] == HERE for e in wheels.load_index(wheels.default_index_path())["entries"]),
                    reason=f"no committed kernel wheel for Python {HERE}")
def test_setup_without_compiler_installs_the_wheel(fresh: Dict[str, Any]) -> None:
    proc = setup_sh(fresh)
    assert proc.returncode == 0, proc.stderr
    steps: List[str] = re.findall(r"^setup: (.+): done in \d+ s$", proc.stderr, re.MULTILINE)
    assert steps[-2:] == ["installing kobold-backend and its dependencies", "installing the native kernels"], steps
    assert "sha256 verified" in proc.stderr and "Traceback" not in proc.stderr
    venv_dir = fresh["checkout"] / ".venv"
    doctor = subprocess.run([str(venv_dir / "bin" / "kobold-backend"), "doctor"], cwd=str(fresh["checkout"]),
                            capture_output=True, text=True, env=no_compiler_env(fresh["tmp"]), timeout=300)
    assert doctor.returncode == 0, doctor.stderr
    cpu = re.search(r"^CPU kernels: prebuilt (\S+) ", doctor.stdout, re.MULTILINE)  # native.status()'s path and file
    assert cpu, doctor.stdout
    module = Path(cpu.group(1))
    assert module.parent.name == "kobold_backend_ext" and venv_dir in module.parents, doctor.stdout
    assert re.search(rf"^Prebuilt wheel installed: {wheels.DIST_NAME} \S+", doctor.stdout, re.MULTILINE), doctor.stdout


def test_setup_check_runs_before_torch_is_installed(tmp_path: Path) -> None:
    """`setup_kernels.py --check` runs where setup.sh calls it: before the torch download, in an environment that
    has only the build tools (pip, setuptools, wheel, pybind11, packaging)."""
    (tmp_path / "bare").mkdir()
    python = new_environment(tmp_path / "bare", keep=BUILD_TOOLS)
    assert subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode != 0
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    (empty / "index.json").write_text(json.dumps(wheels.empty_index()))
    runs = {}
    for name, index in (("committed", None), ("empty", empty)):
        env = no_compiler_env(tmp_path, **({"KOBOLD_BACKEND_WHEELS": str(index)} if index else {}))
        runs[name] = subprocess.run([str(python), str(ROOT / "scripts" / "setup_kernels.py"), "--check"],
                                    capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert runs["empty"].returncode == 1 and "Traceback" not in runs["empty"].stderr, runs["empty"].stderr
    assert runs["empty"].stderr.startswith("setup: no prebuilt kernel wheel fits Python ")
    assert len(runs["empty"].stderr.strip().splitlines()) == 1
    if any(e["python"] == HERE for e in wheels.load_index(wheels.default_index_path())["entries"]):
        assert runs["committed"].returncode == 0 and runs["committed"].stderr == "", runs["committed"].stderr


def load_script(path: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"under_test_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_setup_prefers_a_wheel_built_from_these_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/setup_kernels.py: a wheel of this checkout's sources (for its kind: a CUDA-only change leaves the CPU
    wheel current) wins; one of other sources loses to a compiler and is refused without one (the loader would refuse
    it too); no wheel means compiling, or one sentence when there is no compiler either."""
    kernels = load_script(ROOT / "scripts" / "setup_kernels.py")
    env = dict(wheels.probe_here(), torch_cuda=None, torch_hip=None)
    cpu = [e for e in wheels.load_index(wheels.default_index_path())["entries"]
           if e["python"] == HERE and e["variant"] == "cpu"]
    if not cpu:
        pytest.skip(f"no CPU wheel for Python {HERE}")
    these = {"cpu": "these", "cuda": "these-cuda"}
    edited = {"cpu": "edited", "cuda": "these-cuda"}
    entries = [dict(cpu[0], sources="these")]
    assert kernels.decide(env, entries, None, None, these) == ("wheel", "")
    assert kernels.decide(env, entries, "/usr/bin/g++", None, these) == ("wheel", "")
    assert kernels.decide(env, entries, "/usr/bin/g++", None, {"cpu": "these", "cuda": "edited"}) == ("wheel", ""), \
        "a CUDA-only change leaves the CPU wheel current"
    path, why = kernels.decide(env, entries, "/usr/bin/g++", None, edited)
    assert path == "source" and "built from other sources" in why and why.endswith("compiled here with /usr/bin/g++")
    path, why = kernels.decide(env, entries, None, None, edited)
    assert path == "none" and "the loader would refuse it" in why and "\n" not in why
    path, why = kernels.decide(env, [], "/usr/bin/g++", None, these)
    assert path == "source" and "the index has no wheels" in why
    monkeypatch.delenv("CXX", raising=False)
    path, why = kernels.decide(env, [], None, None, these)
    assert path == "none" and "no c++, g++ or clang++ is on PATH" in why and "\n" not in why


def test_wheel_builder_makes_its_folder_in_an_empty_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tools/build_wheels.py's pybind11 folder on a machine where no earlier build made its parent (pip faked)."""
    tool = load_script(ROOT / "tools" / "build_wheels.py")

    def fake_pip(cmd: List[str], **_: Any) -> subprocess.CompletedProcess:
        target = Path(cmd[cmd.index("--target") + 1])
        assert target.is_dir() and cmd[-1] == "pybind11==9.9.9"
        (target / "pybind11").mkdir()
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(tool.subprocess, "run", fake_pip)
    shim = tool.pybind11_shim("9.9.9")
    assert shim == tmp_path / "kobold-backend-wheel-build" / "pybind11-9.9.9" and (shim / "pybind11").is_dir()
    assert [p.name for p in shim.parent.iterdir()] == ["pybind11-9.9.9"]  # no staging folder left


def test_suite_caches_live_in_this_sessions_folder() -> None:
    """conftest.py points every cache under $TMPDIR for the session: nothing from an earlier run can be found."""
    tmp = Path(tempfile.gettempdir()).resolve()
    for path in (native.cache_root(), demo.default_cache_dir(), Path(os.environ["HF_HOME"]),
                 Path(os.environ["XDG_CONFIG_HOME"]), Path(os.environ["PIP_CACHE_DIR"])):
        assert tmp in path.resolve().parents, path
    assert "KOBOLD_BACKEND_WHEELS" not in os.environ
