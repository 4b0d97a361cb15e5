"""ServerConfig: the settings of one HTTP server instance (limits, security, folders), set by `serve`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple

# KoboldCpp rejects bodies over 32 MB; images in Lite payloads are the only large fields.
DEFAULT_MAX_CONTENT_LENGTH = 32 * 1024 * 1024


@dataclass
class ServerConfig:
    """Everything create_app needs besides the engine holder and the work queue."""

    host: str = "127.0.0.1"
    port: int = 5001
    api_key: Optional[str] = None
    cors_origins: Tuple[str, ...] = ("*",)
    max_queue: int = 6
    max_content_length: int = DEFAULT_MAX_CONTENT_LENGTH
    models_dir: Optional[Path] = None
    default_max_length: int = 180
    chat_template: Optional[str] = None  # Jinja2 source used by /v1/chat/completions instead of the model's own
    passthrough: Optional[Any] = None  # a PassthroughConfig with --enable-passthrough; None refuses the field
