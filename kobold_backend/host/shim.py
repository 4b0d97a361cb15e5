"""The class.py that install-plugin writes into KoboldAI United's modeling/inference_models/kobold_backend/.

It holds no logic: it imports United's InferenceModel when it can, builds the backend class from the
installed kobold_backend package, and registers a disabled backend when the package cannot be imported.
"""

from __future__ import annotations

from pathlib import Path

SHIM_FILENAME = "class.py"

SHIM_TEMPLATE = '''"""KoboldAI United backend plugin: kobold_backend {version}, a native LLM inference engine.

Written by `kobold-backend install-plugin`; `kobold-backend install-plugin <KoboldAI folder> --uninstall`
removes it. The code lives in the kobold_backend package installed in this Python environment.
"""
try:
    from modeling import inference_model as _united
except Exception:  # not inside United, or United's modules failed to import: use the standalone base
    _united = None

try:
    from kobold_backend.host.backend import make_model_backend, model_backend_name, model_backend_type

    model_backend = make_model_backend(_united)
except Exception as _error:  # the package is missing or broken here: register a disabled backend
    import logging as _logging

    model_backend_name = "kobold_backend"
    model_backend_type = "GPTQ"
    _reason = "kobold_backend cannot be imported: {{}}: {{}}".format(type(_error).__name__, _error)
    _logging.getLogger(__name__).warning(_reason)

    class model_backend(_united.InferenceModel if _united is not None else object):
        def __init__(self):
            super().__init__()
            self.disable = True
            self.disable_reason = _reason
'''


def shim_source(version: str) -> str:
    return SHIM_TEMPLATE.format(version=version)


def write_shim(plugin_dir: Path, version: str) -> Path:
    """Write class.py into the plugin folder (created if needed) and return its path."""
    plugin_dir.mkdir(parents=True, exist_ok=True)
    path = plugin_dir / SHIM_FILENAME
    path.write_text(shim_source(version), encoding="utf-8")
    return path
