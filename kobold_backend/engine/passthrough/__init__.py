"""Per-request passthrough: named actions (steer, capture, lora, and registered ones) that a request hands to
Model.forward to observe or change the residual stream and add low-rank deltas; see docs/passthrough.md."""

from __future__ import annotations

from kobold_backend.engine.passthrough.base import Action, ActionContext, PassthroughConfig
from kobold_backend.engine.passthrough.registry import (
    ENTRY_POINT_GROUP,
    ForwardPassthrough,
    build_passthrough,
    known_actions,
    load_entry_points,
    register_action,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Action",
    "ActionContext",
    "ForwardPassthrough",
    "PassthroughConfig",
    "build_passthrough",
    "known_actions",
    "load_entry_points",
    "register_action",
]
