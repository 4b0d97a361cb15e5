"""Shared helpers of the server tests: an engine holder on a tiny fixture checkpoint (optionally slowed down so
that queueing, abort and disconnects can be observed), an app, and a real waitress server on an ephemeral port."""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

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


def hf_greedy(hf_model: Any, ids: List[int], n: int, eos: bool = True) -> List[int]:
    """Greedy continuation by transformers (the oracle); stops after EOS (id 2) unless eos is False."""
    import torch

    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, num_beams=1,
                                eos_token_id=2 if eos else None, pad_token_id=0, attention_mask=None)
    new = out[0, len(ids):].tolist()
    return new[: new.index(2) + 1] if eos and 2 in new else new


def text_of(sp: Any, prompt_ids: List[int], new_ids: List[int]) -> str:
    """The text the new ids add after the prompt (decoded in context, so a leading space is kept)."""
    new_ids = [i for i in new_ids if i != 2]
    return sp.decode(prompt_ids + new_ids)[len(sp.decode(prompt_ids)):]


def perf(server: Any) -> Dict[str, Any]:
    """/api/extra/perf of a live server."""
    import requests

    return requests.get(server.url + "/api/extra/perf", timeout=10).json()


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)
