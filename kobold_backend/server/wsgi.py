"""Serving the app with waitress (cross-platform, streams each SSE event as it is written), in the foreground
for `serve` or on a background thread that can be shut down (tests, embedding). `serve` binds its socket first
(bind_listening_socket), so that a port in use is reported before a model is loaded, and serves on it later."""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
from typing import Any, Optional

from waitress import wasyncore
from waitress.server import create_server

# Disconnects are noticed while a request runs only when waitress keeps reading the socket.
REQUEST_LOOKAHEAD = 1
# Slow or idle clients cost a socket each, never a thread (waitress dispatches only complete requests). waitress's
# defaults (100 connections, 120 s idle timeout checked every 30 s) let 100 half-open sockets lock everyone out for
# two minutes; these keep room for many more and close a connection idle (no complete request) for 20 s.
CONNECTION_LIMIT = 1000
CHANNEL_TIMEOUT = 20
CLEANUP_INTERVAL = 2
FD_RESERVE = 64  # descriptors kept for model files, logs and the worker when the connection limit is derived


def connection_limit() -> int:
    """CONNECTION_LIMIT, or fewer when the process may not open that many files (raising the soft limit first)."""
    try:
        import resource
    except ImportError:  # Windows: no descriptor limit of this kind; waitress uses select()
        return 500
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = CONNECTION_LIMIT + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        new_soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
            soft = new_soft
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return CONNECTION_LIMIT
    return max(16, min(CONNECTION_LIMIT, soft - FD_RESERVE))


class AddressUnavailable(Exception):
    """The address cannot be listened on; the message is one sentence for the person who chose it."""


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening: connections are refused until the server starts)."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise AddressUnavailable(f"--host {host} is not an address of this machine ({e.strerror}).") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        if os.name != "nt":  # on Windows SO_REUSEADDR would let two servers share the port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        where = f"{host}:{port}"
        if e.errno == errno.EADDRINUSE:
            raise AddressUnavailable(f"Port {port} on {host} is already in use (is another server running?); "
                                     "stop it or choose another --port.") from None
        if e.errno == errno.EACCES:
            raise AddressUnavailable(f"Not allowed to listen on {where} (ports below 1024 need privileges); "
                                     "choose another --port.") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise AddressUnavailable(f"--host {host} is not an address of this machine.") from None
        raise AddressUnavailable(f"Cannot listen on {where}: {e.strerror or e}.") from None
    return sock


class WaitressServer:
    """A waitress server bound at construction (port 0 picks a free port), or serving on `sock`, a socket bound
    by bind_listening_socket."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 5001, threads: int = 8,
                 sock: Optional[socket.socket] = None) -> None:
        self.app = app
        body_limit = int(getattr(app, "config", {}).get("MAX_CONTENT_LENGTH") or 0) or 1 << 30
        where: Any = {"sockets": [sock]} if sock is not None else {"host": host, "port": port}
        self.server = create_server(app, threads=threads, channel_request_lookahead=REQUEST_LOOKAHEAD,
                                    ident="kobold_backend", clear_untrusted_proxy_headers=True,
                                    connection_limit=connection_limit(), channel_timeout=CHANNEL_TIMEOUT,
                                    cleanup_interval=CLEANUP_INTERVAL, asyncore_use_poll=hasattr(select, "poll"),
                                    max_request_body_size=body_limit + 1024, **where)
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
