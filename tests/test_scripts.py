"""The programs run by path in another Python (kobold_backend/scripts, kobold_backend/host/scripts): each runs as
a file, the environment probe and the wheel import check with the standard library alone (`python -S`: no
site-packages, so neither torch, pip nor this package), the host-side ones against pip's own view."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import List

from kobold_backend import wheels
from kobold_backend.host import install

HERE = Path(__file__).resolve().parent


def run(args: List[str], cwd: Path, stdin: str = "") -> str:
    proc = subprocess.run([sys.executable, *args], cwd=str(cwd), input=stdin, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def tagged(output: str, tag: str) -> dict:
    (line,) = [x for x in output.splitlines() if x.startswith(tag + " ")]
    return json.loads(line.split(" ", 1)[1])


def test_probe_runs_with_the_standard_library_alone(tmp_path: Path) -> None:
    found = tagged(run(["-S", str(wheels.SCRIPTS / "probe_env.py")], tmp_path), "KOBOLD_BACKEND_PROBE")
    assert found["python"] == platform.python_version() and found["executable"] == sys.executable
    assert found["torch"] is None and "ModuleNotFoundError" in found["torch_error"]
    assert found["tags"] == [] and found["installed_ext"] is None


def test_probe_by_path_and_in_process_agree() -> None:
    by_path = wheels.probe(sys.executable)
    here = wheels.probe_here()
    for key in ("python", "platform", "tags", "torch", "torch_cuda", "driver_cuda", "installed_ext"):
        assert by_path[key] == here[key], key


def test_ext_check_reports_a_missing_module(tmp_path: Path) -> None:
    found = tagged(run(["-S", str(wheels.SCRIPTS / "ext_check.py"), "cpu"], tmp_path), "KOBOLD_BACKEND_EXT_CHECK")
    assert list(found) == ["cpu"] and found["cpu"]["error"].startswith("ModuleNotFoundError")


def test_installed_versions_match_pip(tmp_path: Path) -> None:
    ours = json.loads(run([str(install.SCRIPTS / "installed_versions.py")], tmp_path))
    pip = {d["name"]: d["version"] for d in json.loads(run(["-m", "pip", "list", "--format=json"], tmp_path))}
    norm = {install.normalize(k): v for k, v in ours.items()}
    for name, version in pip.items():
        assert norm.get(install.normalize(name)) == version, name


def test_requirement_plan_sorts_requirements(tmp_path: Path) -> None:
    lines = ["torch>=1.0", "kb-no-such-package==1.0", "pytest<1", 'colorama; sys_platform == "no-such-os"']
    plan = json.loads(run([str(install.SCRIPTS / "requirement_plan.py")], tmp_path, json.dumps(lines)))
    assert plan["missing"] == ["kb-no-such-package==1.0"]
    assert len(plan["conflicts"]) == 1 and plan["conflicts"][0].startswith("pytest ")
    assert list(plan["satisfied"]) == ["torch"]


def test_import_shim_reports_the_backend(tmp_path: Path) -> None:
    """A United-like folder whose plugin module defines model_backend: the script imports it from the cwd."""
    plugin = tmp_path / "modeling" / "inference_models" / "fake_plugin"
    plugin.mkdir(parents=True)
    for folder in (tmp_path / "modeling", tmp_path / "modeling" / "inference_models", plugin):
        (folder / "__init__.py").write_text("")
    (plugin / "class.py").write_text(
        "model_backend_name = 'Fake'\nmodel_backend_type = 'GPTQ'\n"
        "class model_backend:\n"
        "    disable = False\n"
        "    def is_valid(self, name, path, menu):\n"
        "        return name == 'good'\n")
    model = tmp_path / "good"
    out = tagged(run([str(install.SCRIPTS / "import_shim.py"), "fake_plugin", str(model)], tmp_path),
                 "KOBOLD_BACKEND_VERIFY")
    assert (out["name"], out["type"], out["disable"], out["is_valid"]) == ("Fake", "GPTQ", False, True)
    assert out["base"][0] == "modeling.inference_models.fake_plugin.class.model_backend"
