"""pyproject.toml's lower bounds against the United CI job's environment (tests/united/requirements.txt): every
runtime dependency is listed there at exactly its lower bound, so the oldest version the package admits is one a
CI job runs, and that job's environment (KOBOLD_BACKEND_UNITED_ENV, set by scripts/test_united.sh) really holds
those versions on Python 3.8."""

from __future__ import annotations

import os
import re
import sys
from importlib import metadata
from pathlib import Path
from typing import Dict

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib  # novermin
except ImportError:  # Python < 3.11: pytest's own dependency
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
UNITED_REQUIREMENTS = ROOT / "tests" / "united" / "requirements.txt"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def united_versions() -> Dict[str, str]:
    """name -> version of each `name==version` line (extras dropped)."""
    found = {}
    for line in UNITED_REQUIREMENTS.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            found[normalize(req.name)] = spec.version
    return found


def test_each_lower_bound_is_the_version_the_united_job_runs() -> None:
    pinned = united_versions()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for line in project["dependencies"]:
        req = Requirement(line)
        bounds = [s.version for s in req.specifier if s.operator == ">="]
        assert len(bounds) == 1, f"{line}: one lower bound expected"
        name = normalize(req.name)
        assert name in pinned, f"{name} is not in {UNITED_REQUIREMENTS.name}"
        assert Version(pinned[name]) == Version(bounds[0]), f"{line}, but the United job runs {pinned[name]}"


@pytest.mark.skipif(not os.environ.get("KOBOLD_BACKEND_UNITED_ENV"), reason="only in the United job's environment")
def test_the_united_environment_holds_those_versions() -> None:
    assert sys.version_info[:2] == (3, 8)
    installed = {name: metadata.version(name) for name in united_versions()}
    assert installed == united_versions()


def test_the_job_runs_the_pins_plugin_toml_names() -> None:
    """plugin.toml's record of United's environment and the job's environment say the same."""
    from packaging.specifiers import SpecifierSet

    pins = tomllib.loads((ROOT / "plugin.toml").read_text(encoding="utf-8"))["hosts"]["koboldai_united"]["pinned"]
    versions = united_versions()
    for name, pin in pins.items():
        if name != "python":
            assert Version(versions[normalize(name)]) in SpecifierSet("==" + pin), (name, pin)
