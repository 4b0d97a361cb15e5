"""EngineHolder: the currently loaded model and its Generator, swapped by loads that run on the worker thread."""

from __future__ import annotations

import logging
import threading
import traceback
from dataclasses import dataclass, field
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
    load_kwargs: Dict[str, Any] = field(default_factory=dict, compare=False)  # what reloads it after a failed swap

    @property
    def tokenizer(self) -> Any:
        return self.lm.tokenizer

    @property
    def architecture(self) -> Optional[str]:
        """The config.json architecture class the model runs as (e.g. Qwen2ForCausalLM)."""
        return getattr(getattr(self.lm, "config", None), "architecture", None)

    @property
    def weight_format(self) -> Optional[Dict[str, Any]]:
        """How the decoder weights are stored: {"format": "GGUF Q4_K+Q6_K", "bits_per_weight": 4.9} (None: unknown)."""
        fmt = getattr(self.lm, "weight_format", None)
        if fmt is None:
            return None
        return {"format": f"{fmt.name} {fmt.detail}".strip(), "bits_per_weight": round(fmt.bits_per_weight, 2)}


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

    def load(self, path: Path, checkpoint: Any = None, **overrides: Any) -> ActiveModel:
        """Load the folder at `path` with the default kwargs plus overrides, in place of the current model.

        `checkpoint` is the model opened and checked without its weights (engine.loader.open_checkpoint, run by the
        caller while the current model still serves; the loader takes it over): whatever is wrong with the model's
        files is refused before the current model is released. That release comes next (two models rarely fit in
        one GPU). When the new one fails after it (memory, a tensor's data), the memory its partial load took is
        freed, the previous model is loaded again, and the error is raised: a failed load leaves the server
        serving what it served before."""
        kwargs = dict(self.load_kwargs)
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        path = Path(path).resolve()
        with self._lock:
            if checkpoint is not None:
                kwargs["checkpoint"] = checkpoint
            self.loading = path.name
            old = self._active
            previous = None if old is None else (old.path, dict(old.load_kwargs), old.name)
            del old  # nothing here may keep the old model's KV cache alive while the new one loads
            try:
                self._unload_locked()
                try:
                    return self._load_locked(path, kwargs)
                except BaseException as exc:
                    _release_failed_load(exc)
                    if previous is not None:
                        self._restore_locked(*previous)
                    raise
            finally:
                self.loading = None

    def _load_locked(self, path: Path, kwargs: Dict[str, Any]) -> ActiveModel:
        from kobold_backend.engine.generator import Generator

        loader = self._loader
        if loader is None:
            from kobold_backend.engine.loader import load_model as loader
        shown = sorted((k, v) for k, v in kwargs.items() if not callable(v) and k != "checkpoint")
        log.info("loading %s (%s)", path, ", ".join(f"{k}={v}" for k, v in shown))
        lm = loader(path, **kwargs)
        try:
            generator = Generator(lm.model, lm.tokenizer)
            if getattr(lm, "speculation", None) is not None:
                generator.use_speculation(lm.speculation)
        except BaseException:
            lm.unload()
            raise
        active = ActiveModel(
            lm=lm,
            generator=generator,
            name=lm.name,
            path=path,
            is_demo=self.demo_path is not None and path == self.demo_path,
            max_context=int(lm.model.max_seq_len),
            load_kwargs={k: v for k, v in kwargs.items() if k not in ("progress", "checkpoint")},
        )
        self._active = active
        return active

    def _restore_locked(self, path: Path, kwargs: Dict[str, Any], name: str) -> None:
        log.warning("loading the previous model %s again", name)
        try:
            self._load_locked(path, kwargs)
        except Exception as exc:  # noqa: BLE001 - the first error is the one the client gets
            _release_failed_load(exc)
            log.error("the previous model %s could not be loaded again: %s", name, exc)

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


def _release_failed_load(exc: BaseException) -> None:
    """Free what a failed load allocated: the tensors live on in the frames of the exception's traceback until
    those are cleared, then the allocator's cached blocks go back to the device."""
    traceback.clear_frames(exc.__traceback__)
    context = exc.__context__
    while context is not None:
        traceback.clear_frames(context.__traceback__)
        context = context.__context__
    from kobold_backend.engine.release import return_freed_memory

    return_freed_memory()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
