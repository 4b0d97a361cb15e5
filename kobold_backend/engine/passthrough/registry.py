"""The registry of named passthrough actions and build_passthrough: a request's {name: params} spec is
validated whole before generation and turned into one ForwardPassthrough that Model.forward calls.

Built-in actions are `steer`, `capture` and `lora`; more come from `register_action` or the entry-point
group `kobold_backend.passthrough` (name = action name, object = factory(params, ctx) -> Action).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from kobold_backend.engine.passthrough.base import Action, ActionContext, PassthroughConfig
from kobold_backend.engine.passthrough.capture import build_capture
from kobold_backend.engine.passthrough.lora import build_lora
from kobold_backend.engine.passthrough.steer import build_steer
from kobold_backend.errors import RequestError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kobold_backend.passthrough"
Factory = Callable[[Any, ActionContext], Any]
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")

_registry: Dict[str, Factory] = {"steer": build_steer, "capture": build_capture, "lora": build_lora}
_lock = threading.Lock()
_entry_points_loaded = False


def register_action(name: str, factory: Factory, replace: bool = False) -> None:
    """Make `name` usable in requests; `factory(params, ctx)` validates params (raising RequestError via
    `ctx.error(...)`) and returns an Action. Raises ValueError for a bad or already registered name."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"action name {name!r} must be a letter or '_' followed by letters, digits, '_' or '-'")
    if not callable(factory):
        raise ValueError(f"the factory for action {name!r} is not callable")
    with _lock:
        if name in _registry and not replace:
            raise ValueError(f"a passthrough action named {name!r} is already registered")
        _registry[name] = factory


def _entry_points() -> List[Any]:
    """The group's entry points on Python 3.8/3.9 (a dict of lists) and 3.10+ (EntryPoints.select)."""
    from importlib import metadata

    found = metadata.entry_points()
    if hasattr(found, "select"):
        return list(found.select(group=ENTRY_POINT_GROUP))
    return list(found.get(ENTRY_POINT_GROUP, []))  # type: ignore[attr-defined]


def load_entry_points(force: bool = False) -> None:
    """Register every action an installed package declares; a broken one is logged and skipped."""
    global _entry_points_loaded
    if _entry_points_loaded and not force:
        return
    _entry_points_loaded = True
    for ep in _entry_points():
        try:
            factory = ep.load()
            register_action(ep.name, factory)
        except Exception as e:
            log.warning("passthrough action %r from entry point %s was not registered: %s", ep.name, ep.value, e)


def known_actions() -> List[str]:
    load_entry_points()
    with _lock:
        return sorted(_registry)


def _overrides(action: Any, method: str) -> bool:
    impl = getattr(type(action), method, None)
    return callable(impl) and impl is not getattr(Action, method)


class ForwardPassthrough:
    """What Model.forward receives: runs the request's actions in spec order after each layer and sums their
    projection deltas. `eager` tells hosts that this request runs without CUDA graphs or prefix reuse."""

    eager = True

    def __init__(self, actions: List[Tuple[str, Any]], num_layers: int) -> None:
        self.actions: Dict[str, Any] = dict(actions)
        self._after: List[List[Any]] = [[] for _ in range(num_layers)]
        for _, action in actions:
            if _overrides(action, "after_layer"):
                wanted = getattr(action, "layers", None)
                for index in range(num_layers) if wanted is None else wanted:
                    self._after[index].append(action)
        self._delta = [a for _, a in actions if _overrides(a, "linear_delta")]

    @property
    def names(self) -> List[str]:
        return list(self.actions)

    def guide_view(self) -> Optional[ForwardPassthrough]:
        """The actions that change the computation, for a second sequence of the same request (the negative
        prompt of classifier-free guidance), so that recording actions see the main sequence only."""
        active = [(n, a) for n, a in self.actions.items() if not getattr(a, "observe_only", False)]
        return ForwardPassthrough(active, len(self._after)) if active else None

    def begin(self, prompt_tokens: int) -> None:
        """Tell the actions how long the prompt of the coming run is (capture uses it to split phases)."""
        for action in self.actions.values():
            if callable(getattr(action, "begin", None)):
                action.begin(prompt_tokens)

    def after_layer(self, index: int, hidden: torch.Tensor, pos: int) -> torch.Tensor:
        for action in self._after[index]:
            out = action.after_layer(index, hidden, pos)
            if out is not None:
                hidden = out
        return hidden

    def linear_delta(self, index: int, proj: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        total: Optional[torch.Tensor] = None
        for action in self._delta:
            d = action.linear_delta(index, proj, x)
            if d is not None:
                total = d if total is None else total + d
        return total

    def results(self) -> Dict[str, Any]:
        """{action name: its JSON-serialisable result} for the actions that return one."""
        out: Dict[str, Any] = {}
        for name, action in self.actions.items():
            if callable(getattr(action, "results", None)):
                value = action.results()
                if value is not None:
                    out[name] = value
        return out


def build_passthrough(spec: Any, model: Any, config: PassthroughConfig, *, prompt_tokens: Optional[int] = None,
                      max_new_tokens: Optional[int] = None, max_positions: Optional[int] = None) -> ForwardPassthrough:
    """Validate the whole request spec against `model` and `config`, load what it names, and return the object
    to put in GenerationRequest.passthrough. Raises RequestError(message, field="passthrough...") on any problem.

    prompt_tokens / max_new_tokens / max_positions (default: the model's RoPE table length) bound the capture
    volume check; they need not be given.
    """
    if not isinstance(spec, dict):
        raise RequestError("passthrough must be an object of named actions, e.g. {\"steer\": {...}}", "passthrough")
    if not spec:
        raise RequestError(f"passthrough names no action; known actions: {', '.join(known_actions())}", "passthrough")
    known = known_actions()
    for name in spec:
        if name not in known:
            raise RequestError(f"unknown passthrough action {name!r}; known actions: {', '.join(known)}",
                               f"passthrough.{name}")
    bound = int(max_positions if max_positions is not None else model.max_seq_len)
    actions: List[Tuple[str, Any]] = []
    for name, params in spec.items():
        with _lock:
            factory = _registry[name]
        ctx = ActionContext(model, config, f"passthrough.{name}", bound, prompt_tokens, max_new_tokens)
        try:
            action = factory(params, ctx)
        except RequestError:
            raise
        except (ValueError, TypeError) as e:
            raise ctx.error(str(e)) from e
        if not (callable(getattr(action, "after_layer", None)) or callable(getattr(action, "linear_delta", None))):
            raise TypeError(f"the factory of passthrough action {name!r} returned {type(action).__name__}, "
                            "which has neither after_layer nor linear_delta")
        actions.append((name, action))
    return ForwardPassthrough(actions, len(model.layers))
