"""Serving the app with waitress (cross-platform, streams each SSE event as it is written), in the foreground
for `serve` or on a background thread that can be shut down (tests, embedding)."""

from __future__ import annotations

import threading
from typing import Any, Optional

from waitress import wasyncore
from waitress.server import create_server

# Disconnects are noticed while a request runs only when waitress keeps reading the socket.
REQUEST_LOOKAHEAD = 1


class WaitressServer:
    """A waitress server bound at construction (port 0 picks a free port)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 5001, threads: int = 8) -> None:
        self.app = app
        self.server = create_server(app, host=host, port=port, threads=threads,
                                    channel_request_lookahead=REQUEST_LOOKAHEAD, ident="kobold_backend",
                                    clear_untrusted_proxy_headers=True)
        self.host = host
        self.port = int(self.server.effective_port)  # type: ignore[union-attr]
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def serve_forever(self) -> None:
        self.server.run()

    def start(self) -> WaitressServer:
        """Serve on a daemon thread."""
        self._thread = threading.Thread(target=self.serve_forever, name="kobold-backend-http", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort the app's jobs, stop the request threads, close the listening socket and every connection."""
        state = getattr(self.app, "extensions", {}).get("kobold_backend")
        if state is not None:
            state.close()
        srv = self.server
        srv.task_dispatcher.shutdown(timeout=timeout)  # type: ignore[union-attr]
        wasyncore.close_all(srv._map)  # type: ignore[union-attr]
        if self._thread is not None:
            self._thread.join(timeout)
