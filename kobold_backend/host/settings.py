"""Per-model load settings saved the way KoboldAI United's backends do: JSON in
settings/<model>.kobold_backend.model_backend.settings, relative to United's root (its working directory).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, Optional

PLUGIN_FOLDER = "kobold_backend"
SETTINGS_DIR = Path("settings")

log = logging.getLogger(__name__)


def settings_path(model_name: str, settings_dir: Optional[Path] = None) -> Path:
    """United's file name: the model name with "/" turned into "_" (also "\\" and ":" so Windows paths work)."""
    safe = model_name.replace("/", "_").replace("\\", "_").replace(":", "_")
    return (settings_dir if settings_dir is not None else SETTINGS_DIR) / (
        f"{safe}.{PLUGIN_FOLDER}.model_backend.settings"
    )


def read_settings(model_name: str, settings_dir: Optional[Path] = None) -> Dict[str, Any]:
    """The saved values for this model, or {} when there are none or the file is unreadable."""
    path = settings_path(model_name, settings_dir)
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable settings file %s (%s)", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def write_settings(model_name: str, values: Dict[str, Any], settings_dir: Optional[Path] = None) -> Path:
    """Write the values as JSON (creating the settings folder if needed) and return the file's path."""
    path = settings_path(model_name, settings_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(values, indent=1, sort_keys=True), encoding="utf-8")
    return path
