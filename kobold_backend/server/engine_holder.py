"""EngineHolder: the currently loaded model and its Generator, swapped by loads that run on the worker thread."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional

log = logging.getLogger(__name__)

Loader = Callable[..., Any]


@dataclass(frozen=True)
class ActiveModel:
    """A snapshot of what is loaded; request code takes one and uses it throughout."""

    lm: Any
    generator: Any
    name: str
    path: Path
    is_demo: bool
    max_context: int

    @property
    def tokenizer(self) -> Any:
        return self.lm.tokenizer

    @property
    def architecture(self) -> Optional[str]:
        """The config.json architecture class the model runs as (e.g. Qwen2ForCausalLM)."""
        return getattr(getattr(self.lm, "config", None), "architecture", None)


class EngineHolder:
    """Owns the LoadedModel and its Generator. Loads and unloads are called from the work queue's worker
    thread so that they never overlap a generation."""

    def __init__(self, loader: Optional[Loader] = None, load_kwargs: Optional[Dict[str, Any]] = None,
                 demo_path: Optional[Path] = None) -> None:
        self._loader = loader
        self.load_kwargs: Dict[str, Any] = dict(load_kwargs or {})
        self.demo_path = Path(demo_path).resolve() if demo_path is not None else None
        self._active: Optional[ActiveModel] = None
        self._lock = threading.Lock()
        self.loading: Optional[str] = None

    @property
    def active(self) -> Optional[ActiveModel]:
        return self._active

    def load(self, path: Path, **overrides: Any) -> ActiveModel:
        """Unload the current model, then load the folder at `path` with the default kwargs plus overrides."""
        from kobold_backend.engine.generator import Generator

        loader = self._loader
        if loader is None:
            from kobold_backend.engine.loader import load_model as loader
        kwargs = dict(self.load_kwargs)
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        path = Path(path).resolve()
        with self._lock:
            self.loading = path.name
            try:
                self._unload_locked()
                log.info("loading %s (%s)", path, ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items())))
                lm = loader(path, **kwargs)
                active = ActiveModel(
                    lm=lm,
                    generator=Generator(lm.model, lm.tokenizer),
                    name=lm.name,
                    path=path,
                    is_demo=self.demo_path is not None and path == self.demo_path,
                    max_context=int(lm.model.max_seq_len),
                )
                self._active = active
                return active
            finally:
                self.loading = None

    def unload(self) -> None:
        """Free the current model (United's "ReadOnly")."""
        with self._lock:
            self._unload_locked()

    def _unload_locked(self) -> None:
        old, self._active = self._active, None
        if old is not None:
            log.info("unloading %s", old.name)
            unload = getattr(old.lm, "unload", None)
            if unload is not None:
                unload()
