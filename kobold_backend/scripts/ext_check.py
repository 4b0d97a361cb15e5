"""Imports each kernel module of an installed kobold_backend_ext wheel (names given as arguments: cpu, cuda) and
prints `KOBOLD_BACKEND_EXT_CHECK <json>` with each module's fingerprint or its import error.

kobold_backend.wheels runs this file by path with the target interpreter after pip installed the wheel; it uses
the standard library only and imports nothing from kobold_backend.
"""

import importlib
import json
import sys
from typing import Any, Dict, Sequence


def check(names: Sequence[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name in names:
        try:
            module = importlib.import_module("kobold_backend_ext." + name)
            out[name] = {"fingerprint": dict(module.fingerprint()), "file": module.__file__}
        except Exception as exc:  # report any failure of the import
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


if __name__ == "__main__":
    print("KOBOLD_BACKEND_EXT_CHECK " + json.dumps(check(sys.argv[1:])))
