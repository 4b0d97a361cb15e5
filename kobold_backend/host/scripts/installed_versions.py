"""Prints, as JSON, what `pip freeze --all` would list in this Python (name -> version), read through
importlib.metadata (the first distribution of each name on sys.path, as pip reports it) without pip's start-up
cost. Run by kobold_backend/host/install.py in the host's Python; standard library only."""

import json
import os
import sys
from typing import Dict

try:
    from importlib import metadata
except ImportError:  # Python < 3.8 hosts with the backport
    import importlib_metadata as metadata  # type: ignore[no-redef]


def installed_versions() -> Dict[str, str]:
    found: Dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and name not in found:
            found[name] = dist.version
    return found


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # see the host's folder, not this one, as `python -c` does
    print(json.dumps(installed_versions()))
