"""`kobold-backend install-plugin` against a temporary folder laid out like a KoboldAI United checkout with its
own virtual environment at runtime/envs/koboldai (torch and the rest come from this test environment through a
.pth file, kobold-backend itself does not). Checked with that environment's own pip and Python: install,
the shim imported the way aiserver.py does, pins unchanged, idempotence, uninstall, reinstall, refusals."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib
import io
import json
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Dict

import pytest

import kobold_backend
from kobold_backend import wheels
from kobold_backend.cli.main import main as cli_main
from kobold_backend.host.install import (
    MANIFEST,
    InstallError,
    build_wheel,
    find_host_python,
    freeze,
    install,
    project_requirements,
    uninstall,
)
from kobold_backend.host.settings import PLUGIN_FOLDER
from tests.fixtures.checkpoints import CheckpointFactory

OURS = re.compile(r"kobold[_-]backend|__editable__", re.IGNORECASE)


def make_koboldai(root: Path) -> Path:
    """aiserver.py, modeling/inference_models/ and a venv at runtime/envs/koboldai that sees this environment's
    packages (except kobold-backend) through a .pth file pointing at a filtered mirror of site-packages."""
    root.mkdir(parents=True)
    (root / "aiserver.py").write_text("# KoboldAI United stand-in\n")
    (root / "modeling" / "inference_models").mkdir(parents=True)
    env = root / "runtime" / "envs" / "koboldai"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(env)], check=True)
    mirror = root.parent / "host-site-packages"
    mirror.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not OURS.search(entry.name) and entry.suffix != ".pth":
            (mirror / entry.name).symlink_to(entry)
    python = find_host_python(root)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "united_test_env.pth").write_text(str(mirror) + "\n")
    return root


def tiny_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel (one module) for testing dependency installs without an index."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n".encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
              for n, d in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for n, d in files.items():
            zf.writestr(n, d)
    return path


@pytest.fixture(scope="module")
def koboldai(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_koboldai(tmp_path_factory.mktemp("united") / "KoboldAI")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's Python must find kobold_backend where install put it, not through this checkout."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)


def kernel_wheel(python: Path) -> set:
    """{"kobold-backend-ext"} when the committed wheel index has a wheel for the host's environment, else {}."""
    decision = wheels.select(wheels.probe(str(python)), wheels.load_index(wheels.default_index_path())["entries"])
    return {"kobold-backend-ext"} if decision.entry is not None else set()


def host_import(python: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-c", code], cwd=str(cwd), capture_output=True, text=True)


@pytest.mark.slow
def test_install_uninstall_reinstall(koboldai: Path, checkpoints: CheckpointFactory, tmp_path: Path) -> None:
    python = find_host_python(koboldai)
    plugin = koboldai / "modeling" / "inference_models" / PLUGIN_FOLDER
    original = freeze(python, koboldai)
    assert "kobold-backend" not in original and "torch" in original
    assert host_import(python, "import kobold_backend", koboldai).returncode != 0
    wheelhouse = tmp_path / "wheelhouse"
    tiny_wheel(wheelhouse, "kbtestdep", "1.2.0")
    model = checkpoints.get("dense_fp32").path
    requirements = project_requirements() + ["kbtestdep>=1.0"]
    pip_args = ["--no-index", "--find-links", str(wheelhouse)]
    lines = []
    ext = kernel_wheel(python)

    manifest = install(koboldai, verify_model=model, pip_args=pip_args, requirements=requirements, say=lines.append)
    assert any("Installing missing dependencies: kbtestdep>=1.0" in line for line in lines)
    assert manifest["packages"] == sorted({"kbtestdep", "kobold-backend"} | ext)
    assert manifest["verified"]["is_valid"] is True and manifest["verified"]["disable"] is False
    site = Path(manifest["verified"]["package"]).resolve()
    assert str(site).startswith(str(koboldai.resolve() / "runtime")), site
    assert (plugin / "class.py").is_file() and (plugin / MANIFEST).is_file()
    installed = freeze(python, koboldai)
    assert {k: v for k, v in installed.items() if k in original} == original  # pins untouched
    assert set(installed) - set(original) == {"kobold-backend", "kbtestdep"} | ext
    # the environment also gets the command line, as `pip install .` gives it
    scripts = host_import(python, "import sysconfig; print(sysconfig.get_path('scripts'))", koboldai).stdout.strip()
    command = subprocess.run([str(Path(scripts) / "kobold-backend"), "--version"], capture_output=True, text=True)
    assert command.returncode == 0 and kobold_backend.__version__ in command.stdout, command.stderr

    # United's import of the shim, in the host's Python, with the folder browser's is_valid
    probe = host_import(python, (
        "import importlib, sys; sys.path.insert(0, '.');"
        f"m = importlib.import_module('modeling.inference_models.{PLUGIN_FOLDER}.class');"
        f"b = m.model_backend(); print(m.model_backend_name, b.disable, b.is_valid('x', {str(model)!r}, 'Custom'),"
        " b.is_valid('x', '.', 'Custom'))"), koboldai)
    assert probe.stdout.split() == ["kobold_backend", "False", "True", "False"], probe.stderr

    # idempotent: the same command again (through the CLI) changes nothing and keeps the record
    assert cli_main(["install-plugin", str(koboldai), "--no-check-model", "--pip-arg=--no-index"]) == 0
    assert freeze(python, koboldai) == installed
    again = json.loads((plugin / MANIFEST).read_text())
    assert again["packages"] == manifest["packages"] and again["host_pins"] == manifest["host_pins"]

    assert cli_main(["install-plugin", str(koboldai), "--uninstall"]) == 0
    assert freeze(python, koboldai) == original
    assert not plugin.exists()
    assert host_import(python, "import kobold_backend", koboldai).returncode != 0
    assert not uninstall(koboldai, say=lines.append)  # nothing left to remove

    reinstalled = install(koboldai, verify_model=model, say=lines.append)
    assert reinstalled["packages"] == sorted({"kobold-backend"} | ext) and reinstalled["verified"]["is_valid"] is True
    assert set(freeze(python, koboldai)) - set(original) == {"kobold-backend"} | ext


def test_refuses_a_folder_that_is_not_koboldai(tmp_path: Path) -> None:
    (tmp_path / "modeling").mkdir()
    with pytest.raises(InstallError, match="not a KoboldAI United checkout"):
        install(tmp_path, python=sys.executable)
    assert cli_main(["install-plugin", str(tmp_path), "--python", sys.executable]) == 1
    assert not (tmp_path / "modeling" / "inference_models").exists()


def test_refuses_to_change_a_pinned_package(koboldai: Path) -> None:
    python = find_host_python(koboldai)
    plugin = koboldai / "modeling" / "inference_models" / PLUGIN_FOLDER

    def snapshot() -> Dict[str, bytes]:
        return {p.name: p.read_bytes() for p in plugin.glob("*") if p.is_file()} if plugin.is_dir() else {}

    before, files = freeze(python, koboldai), snapshot()
    with pytest.raises(InstallError, match="Refusing to change the host's pinned packages"):
        install(koboldai, requirements=["torch>=999"], say=lambda line: None)
    assert freeze(python, koboldai) == before and snapshot() == files


def test_needs_a_host_python(tmp_path: Path) -> None:
    (tmp_path / "aiserver.py").touch()
    (tmp_path / "modeling" / "inference_models").mkdir(parents=True)
    with pytest.raises(InstallError, match="--python"):
        install(tmp_path)
    with pytest.raises(InstallError, match="is not a file"):
        install(tmp_path, python=str(tmp_path / "nope"))


def test_wheel_is_pure_python_with_a_valid_record(tmp_path: Path) -> None:
    requirements = project_requirements()
    wheel = build_wheel(tmp_path, requirements)
    assert wheel.name == f"kobold_backend-{kobold_backend.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        data: Dict[str, bytes] = {n: zf.read(n) for n in names}
    assert "kobold_backend/host/backend.py" in names and "kobold_backend/__init__.py" in names
    assert not [n for n in names if n.endswith((".so", ".pyd", ".pyc")) or "__pycache__" in n]
    dist = f"kobold_backend-{kobold_backend.__version__}.dist-info"
    metadata = data[f"{dist}/METADATA"].decode()
    assert "Name: kobold-backend" in metadata
    assert [line[len("Requires-Dist: "):] for line in metadata.splitlines()
            if line.startswith("Requires-Dist: ")] == requirements
    rows = list(csv.reader(io.StringIO(data[f"{dist}/RECORD"].decode())))
    assert {row[0] for row in rows} == set(names)
    for name, digest, size in rows:
        if name.endswith("RECORD"):
            continue
        expected = base64.urlsafe_b64encode(hashlib.sha256(data[name]).digest()).rstrip(b"=").decode()
        assert digest == f"sha256={expected}" and int(size) == len(data[name])


def test_plugin_toml_agrees_with_the_code() -> None:
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((Path(kobold_backend.__file__).parent.parent / "plugin.toml").read_text())
    plugin = data["plugin"]
    assert plugin["name"] == "kobold_backend" and plugin["version"] == kobold_backend.__version__
    module, _, attr = plugin["entry_point"].partition(":")
    factory = getattr(__import__(module, fromlist=[attr]), attr)
    backend_cls = factory(None)
    assert backend_cls.__name__ == "model_backend"
    united = data["hosts"]["koboldai_united"]
    assert united["install_folder"] == f"modeling/inference_models/{PLUGIN_FOLDER}"
    assert united["backend_name"] == "kobold_backend"
    assert data["wheels"]["index"] == "wheels/index.json"
    assert united["python"] == ">=3.8" and united["torch"] == ">=2.1"
    assert united["pinned"]["transformers"] == "4.36.1"


def test_the_plugin_wheel_declares_the_projects_command(tmp_path: Path) -> None:
    """install-plugin's wheel gives United's environment the same `kobold-backend` script as `pip install .`:
    pyproject.toml's [project.scripts] entry, which names a function that exists."""
    pyproject = (Path(kobold_backend.__file__).resolve().parent.parent / "pyproject.toml").read_text()
    section = pyproject.split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    declared = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', section, re.M))
    assert declared == {"kobold-backend": "kobold_backend.cli.main:main"}
    wheel = build_wheel(tmp_path, project_requirements())
    with zipfile.ZipFile(wheel) as zf:
        entry = zf.read(f"kobold_backend-{kobold_backend.__version__}.dist-info/entry_points.txt").decode()
    assert entry.splitlines() == ["[console_scripts]"] + [f"{k} = {v}" for k, v in declared.items()]
    module, _, attr = declared["kobold-backend"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
