"""Shared helpers of the server tests: an engine holder on a tiny fixture checkpoint (optionally slowed down so
that queueing, abort and disconnects can be observed), an app, and a real waitress server on an ephemeral port."""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from kobold_backend.engine.loader import load_model
from kobold_backend.server import ServerConfig, create_app
from kobold_backend.server.engine_holder import EngineHolder
from kobold_backend.server.wsgi import WaitressServer

CONTEXT = 128


def slow_loader(delay: float) -> Any:
    """load_model, with every forward pass of the real model taking at least `delay` seconds longer."""

    def load(path: Path, **kwargs: Any) -> Any:
        lm = load_model(path, **kwargs)
        forward = lm.model.forward

        @functools.wraps(forward)
        def slowed(*args: Any, **kw: Any) -> Any:
            time.sleep(delay)
            return forward(*args, **kw)

        lm.model.forward = slowed
        return lm

    return load


def make_holder(model_path: Path, delay: float = 0.0, context: int = CONTEXT) -> EngineHolder:
    holder = EngineHolder(loader=slow_loader(delay) if delay else None,
                          load_kwargs={"device": "cpu", "max_seq_len": context})
    holder.load(model_path)
    return holder


def make_app(model_path: Optional[Path], delay: float = 0.0, **config: Any) -> Any:
    holder = make_holder(model_path, delay) if model_path is not None else EngineHolder()
    return create_app(ServerConfig(**config), holder)


@contextlib.contextmanager
def live_server(app: Any, threads: int = 8) -> Iterator[WaitressServer]:
    """Serve `app` with waitress on 127.0.0.1:<free port> in a thread; always shut down."""
    server = WaitressServer(app, host="127.0.0.1", port=0, threads=threads).start()
    try:
        yield server
    finally:
        server.shutdown()
