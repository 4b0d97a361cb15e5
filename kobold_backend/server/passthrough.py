"""The server's passthrough hook: the generate body's `passthrough` field is checked before the job is queued
(403 unless the server runs with --enable-passthrough, 422 for a bad spec), each engine request of the job gets
its own ForwardPassthrough, and the job's results carry `passthrough_results`. See docs/passthrough.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from kobold_backend.server.errors import ApiError

DISABLED_MESSAGE = "passthrough is disabled on this server; start it with --enable-passthrough"


class PassthroughDisabled(ApiError):
    status = 403
    type = "forbidden"
    msg = DISABLED_MESSAGE


@dataclass
class RequestPassthrough:
    """A validated spec and the server's PassthroughConfig; `attach` builds a fresh object per engine request."""

    spec: Dict[str, Any]
    config: Any

    def attach(self, active: Any, req: Any) -> Any:
        from kobold_backend.engine.passthrough import build_passthrough

        pt = build_passthrough(self.spec, active.lm.model, self.config, prompt_tokens=len(req.prompt_ids),
                               max_new_tokens=req.max_new_tokens, max_positions=active.max_context)
        req.passthrough = pt
        return pt


def from_body(state: Any, body: Any, params: Any) -> Optional[RequestPassthrough]:
    """None without the field; raises PassthroughDisabled, or RequestError for an invalid spec (checked with
    the request's own length bounds, so the per-request builds on the worker cannot fail on volume)."""
    spec = body.get("passthrough") if isinstance(body, dict) else None
    if spec is None:
        return None
    config = state.config.passthrough
    if config is None:
        raise PassthroughDisabled()
    from kobold_backend.engine.passthrough import build_passthrough
    from kobold_backend.engine.request import fit_lengths

    active = state.require_model()
    wanted = state.config.default_max_length if params.max_length is None else params.max_length
    budget, max_new = fit_lengths(active.max_context, wanted, params.max_context_length)
    build_passthrough(spec, active.lm.model, config, prompt_tokens=budget, max_new_tokens=max_new,
                      max_positions=active.max_context)
    return RequestPassthrough(spec, config)
