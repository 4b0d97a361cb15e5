"""The pieces every passthrough action shares: the ForwardHooks protocol Model.forward calls, the server-side
PassthroughConfig (folders, limits, caches), the Action base class a factory returns, and the ActionContext a
factory validates its parameters against."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Hashable, Optional, Protocol

import torch

from kobold_backend.errors import RequestError


class ForwardHooks(Protocol):
    """What Model.forward calls while a request runs (the `passthrough` of GenerationRequest, Lane and
    Model.forward): an Action, the ForwardPassthrough that runs a request's actions, or any object with these two
    methods. Two more are optional and called when present: `begin(prompt_tokens)` before a run, and
    `guide_view()` giving the hooks a classifier-free-guidance lane runs (None: none; absent: the same hooks).
    """

    def after_layer(self, index: int, hidden: torch.Tensor, pos: int) -> Optional[torch.Tensor]:
        """The residual stream after decoder layer `index`, [B, T, H] at positions pos..pos+T-1; None: unchanged."""

    def linear_delta(self, index: int, proj: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        """A delta added to projection `proj` of layer `index` for its input x [B, T, K], or None."""


class LRUCache:
    """A small thread-safe least-recently-used cache; `get_or_load` runs the loader under the lock, so two
    requests for the same file load it once."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get_or_load(self, key: Hashable, loader: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            value = loader()
            self._items[key] = value
            while len(self._items) > max(0, self.capacity):
                self._items.popitem(last=False)
            return value

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


@dataclass
class PassthroughConfig:
    """Server-side settings: where named files live and how much one request may ask for.

    Request paths are names resolved inside these folders only; a folder left as None turns its feature off.
    """

    vectors_dir: Optional[Path] = None
    lora_dir: Optional[Path] = None
    capture_output_dir: Optional[Path] = None
    max_inline_vector: int = 65536  # floats in one inline steering vector
    max_steer_entries: int = 16  # vectors in one `steer` action
    max_loras: int = 8  # adapters in one `lora` action
    max_capture_values_inline: int = 8 * 1024 * 1024  # captured floats returned in the JSON response
    max_capture_values_file: int = 512 * 1024 * 1024  # captured floats written to capture_output_dir
    vector_cache_size: int = 32
    lora_cache_size: int = 4
    vector_cache: LRUCache = field(init=False, repr=False, compare=False)
    lora_cache: LRUCache = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("vectors_dir", "lora_dir", "capture_output_dir"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, Path(value))
        self.vector_cache = LRUCache(self.vector_cache_size)
        self.lora_cache = LRUCache(self.lora_cache_size)


class Action:
    """One named action of a request. Override `after_layer` and/or `linear_delta`; the rest is optional.

    `layers` lists the layers whose `after_layer` is called (None: every layer). A hook returns None to leave
    the tensor unchanged. `observe_only` marks actions that never change the computation. Hooks run inside the
    model's inference mode, on the layer's device and dtype.
    """

    layers: Optional[Collection[int]] = None
    observe_only = False  # True for actions that only record (left out of a CFG negative-prompt lane)

    def begin(self, prompt_tokens: int) -> None:
        """Called (when the host knows it) before a run with the number of prompt tokens."""

    def after_layer(self, index: int, hidden: torch.Tensor, pos: int) -> Optional[torch.Tensor]:
        """The residual stream after decoder layer `index`, [B, T, H] at positions pos..pos+T-1."""
        return None

    def linear_delta(self, index: int, proj: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        """A delta added to projection `proj` of layer `index` for its input x [B, T, K]."""
        return None

    def results(self) -> Optional[Any]:
        """JSON-serialisable output for the response's `passthrough_results`, or None."""
        return None


@dataclass
class ActionContext:
    """What a factory validates against: the model, the server's config and the request's field path.

    `max_positions` bounds how many positions one run can process; `prompt_tokens` and `max_new_tokens`
    are set when the caller knows them (tighter capture-volume checks).
    """

    model: Any
    config: PassthroughConfig
    field: str
    max_positions: int
    prompt_tokens: Optional[int] = None
    max_new_tokens: Optional[int] = None

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def error(self, message: str, sub: str = "") -> RequestError:
        """A RequestError for `<field><sub>` (sub like ".layers[2]" or "[0].name")."""
        return RequestError(message, self.field + sub)

    def layer_device(self, index: int) -> torch.device:
        return self.model.layers[index].device

    def layer_dtype(self, index: int) -> torch.dtype:
        return self.model.layers[index].input_norm.dtype
