"""create_app: the Flask application factory; the engine holder and the work queue are injected."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional

from flask import Flask

from kobold_backend.server import api_extra, api_v1, openai_api, web
from kobold_backend.server.auth import install_auth_and_cors
from kobold_backend.server.config import ServerConfig
from kobold_backend.server.engine_holder import EngineHolder
from kobold_backend.server.errors import register_error_handlers
from kobold_backend.server.generation import PerfStats
from kobold_backend.server.memory import trim_after_large_bodies
from kobold_backend.server.queue import WorkQueue
from kobold_backend.server.state import ServerState

STATIC = Path(__file__).parent / "static"


class _StripTrailingSlash:
    """KoboldCpp and United accept API paths with a trailing slash (Horde posts to /api/latest/generate/)."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app

    def __call__(self, environ: Dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path.startswith("/api/") and len(path) > 5 and path.endswith("/"):
            environ["PATH_INFO"] = path.rstrip("/")
        return self.app(environ, start_response)


def create_app(config: ServerConfig, engine_holder: EngineHolder, work_queue: Optional[WorkQueue] = None) -> Flask:
    """Build the app. Call `app.extensions["kobold_backend"].close()` to stop its worker thread."""
    app = Flask(__name__, static_folder=str(STATIC), static_url_path="/static")
    app.config["MAX_CONTENT_LENGTH"] = config.max_content_length
    app.json.sort_keys = False  # type: ignore[attr-defined]
    state = ServerState(config=config, holder=engine_holder,
                        queue=work_queue if work_queue is not None else WorkQueue(config.max_queue),
                        perf=PerfStats())
    app.extensions["kobold_backend"] = state
    register_error_handlers(app)
    install_auth_and_cors(app, config)
    trim_after_large_bodies(app)
    app.register_blueprint(api_v1.bp, url_prefix="/api/v1")
    app.register_blueprint(api_v1.bp, url_prefix="/api/latest", name="api_latest")
    app.register_blueprint(api_extra.bp, url_prefix="/api/extra")
    app.register_blueprint(openai_api.bp, url_prefix="/v1")
    app.register_blueprint(web.bp)
    app.wsgi_app = _StripTrailingSlash(app.wsgi_app)  # type: ignore[method-assign]
    return app
