"""Reads requirement lines (a JSON list) on stdin and prints, as JSON, which are missing in this Python, which
installed versions conflict, and which are satisfied. Run by kobold_backend/host/install.py in the host's Python;
standard library plus `packaging` (pip's vendored copy when packaging itself is not installed)."""

import json
import os
import sys
from typing import Any, Dict, List

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
try:
    from importlib import metadata
except ImportError:  # Python < 3.8 hosts with the backport
    import importlib_metadata as metadata  # type: ignore[no-redef]


def requirement_plan(lines: List[str]) -> Dict[str, Any]:
    plan: Dict[str, Any] = {"missing": [], "conflicts": [], "satisfied": {}}
    for line in lines:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            plan["missing"].append(line)
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            plan["conflicts"].append(f"{req.name} {version} is installed but kobold-backend needs {line}")
        else:
            plan["satisfied"][req.name] = version
    return plan


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # see the host's folder, not this one, as `python -c` does
    print(json.dumps(requirement_plan(json.loads(sys.stdin.read()))))
