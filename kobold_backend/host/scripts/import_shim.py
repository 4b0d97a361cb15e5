"""Imports the plugin's class.py the way United's aiserver.py does (argv: the plugin folder name under
modeling/inference_models, then optionally a model folder for is_valid) and prints
`KOBOLD_BACKEND_VERIFY <json>`: the backend's name, type, disable state, base classes and package file. Run by
kobold_backend/host/install.py in the host's Python from United's folder; standard library only."""

import importlib
import json
import os
import sys
from typing import Any, Dict, Optional


def import_shim(plugin_folder: str, model: Optional[str]) -> Dict[str, Any]:
    module = importlib.import_module(f"modeling.inference_models.{plugin_folder}.class")
    backend = module.model_backend()
    out = {"name": module.model_backend_name, "type": module.model_backend_type,
           "disable": bool(getattr(backend, "disable", False)), "reason": getattr(backend, "disable_reason", None),
           "base": [c.__module__ + "." + c.__name__ for c in type(backend).__mro__],
           "package": getattr(sys.modules.get("kobold_backend"), "__file__", None)}
    if model is not None and not out["disable"]:
        out["is_valid"] = bool(backend.is_valid(os.path.basename(model), model, "Custom"))
    return out


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # United's folder, where `modeling` lives
    print("KOBOLD_BACKEND_VERIFY " + json.dumps(import_shim(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)))
