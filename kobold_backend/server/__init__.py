"""The embedded HTTP host: KoboldAI United /api/v1, KoboldCpp /api/extra and the web page, built by create_app."""

from __future__ import annotations

from kobold_backend.server.app import create_app
from kobold_backend.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
