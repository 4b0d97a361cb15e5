"""The `capture` action: hidden states (the residual stream after chosen decoder layers, HF's
hidden_states[i + 1]) at the last or every position, for the prompt and/or each generated token; returned
base64-encoded in the results or written atomically as safetensors into capture_output_dir."""

from __future__ import annotations

import base64
import json
import logging
import os
import tempfile
from typing import Any, Dict, List, Optional

import torch

from kobold_backend.engine.passthrough.base import Action, ActionContext
from kobold_backend.engine.passthrough.checks import (
    as_choice,
    as_layers,
    as_object,
    as_string,
    check_file_name,
)

log = logging.getLogger(__name__)

CAPTURE_KEYS = ("layers", "positions", "phase", "dtype", "output")
PHASES = ("prompt", "generated")
POSITIONS = ("last", "all")
DTYPES = {"float16": torch.float16, "float32": torch.float32}
NUMPY_DTYPES = {"float16": "<f2", "float32": "<f4"}


class CaptureAction(Action):
    """Keeps one row [B, H] per (phase, layer, position) on the CPU until `results()` encodes or writes them.

    The phase of a forward call is told by the prompt length when known (`begin`, or the build hint);
    otherwise a call at position 0 or of more than one token is prompt, and a one-token call after it is a
    generated token. A call at a position already held (a generator rewind) drops the rows from there on.
    """

    observe_only = True

    def __init__(self, ctx: ActionContext, layers: List[int], positions: str, phases: List[str], dtype: str,
                 output: Optional[str], limit: int) -> None:
        self.layers = frozenset(layers)
        self.positions = positions
        self.phases = phases
        self.dtype_name = dtype
        self.output = output
        self.output_dir = ctx.config.capture_output_dir
        self.hidden_size = ctx.hidden_size
        self.prompt_tokens = ctx.prompt_tokens
        self.limit = limit
        self.truncated = False
        self.rows: Dict[str, Dict[int, Dict[int, torch.Tensor]]] = {p: {i: {} for i in layers} for p in PHASES}

    def begin(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        for phase in self.rows.values():
            for rows in phase.values():
                rows.clear()
        self.truncated = False

    def _phase(self, pos: int, t: int) -> str:
        if self.prompt_tokens is not None:
            return "prompt" if pos < self.prompt_tokens else "generated"
        return "prompt" if pos == 0 or t > 1 else "generated"

    def _held(self) -> int:
        return sum(len(rows) for phase in self.rows.values() for rows in phase.values())

    def after_layer(self, index: int, hidden: torch.Tensor, pos: int) -> Optional[torch.Tensor]:
        b, t, h = hidden.shape
        if pos == 0:
            for phase in self.rows.values():
                phase[index].clear()
        phase = self._phase(pos, t)
        if phase not in self.phases:
            return None
        rows = self.rows[phase][index]
        for stale in [p for p in rows if p >= pos]:
            del rows[stale]
        if self.positions == "last" and phase == "prompt":
            rows.clear()
            hidden, pos, t = hidden[:, -1:], pos + t - 1, 1
        if (self._held() + t) * b * h > self.limit:
            self.truncated = True
            return None
        chunk = hidden.detach().to(device="cpu", dtype=DTYPES[self.dtype_name], copy=True)
        for j in range(t):
            rows[pos + j] = chunk[:, j]
        return None

    def _tensors(self) -> Dict[str, Dict[int, Any]]:
        out: Dict[str, Dict[int, Any]] = {}
        for phase in self.phases:
            out[phase] = {}
            for layer in sorted(self.layers):
                rows = self.rows[phase][layer]
                keys = sorted(rows)
                if keys:
                    stacked = torch.stack([rows[k] for k in keys], dim=1)
                else:
                    stacked = torch.zeros((1, 0, self.hidden_size), dtype=DTYPES[self.dtype_name])
                out[phase][layer] = (stacked.contiguous(), keys)
        return out

    def results(self) -> Dict[str, Any]:
        tensors = self._tensors()
        out: Dict[str, Any] = {"layers": sorted(self.layers), "positions": self.positions, "dtype": self.dtype_name}
        if self.truncated:
            out["truncated"] = True
        for phase, layers in tensors.items():
            section: Dict[str, Any] = {}
            for layer, (t, keys) in layers.items():
                entry: Dict[str, Any] = {"shape": list(t.shape), "dtype": self.dtype_name, "positions": keys}
                if self.output is None:
                    raw = t.numpy().astype(NUMPY_DTYPES[self.dtype_name], copy=False).tobytes()
                    entry["data"] = base64.b64encode(raw).decode("ascii")
                section[str(layer)] = entry
            out[phase] = section
        if self.output is not None:
            out["file"] = self.output
            try:
                self._write(tensors)
            except OSError as e:
                log.error("could not write capture file %s: %s", self.output, e)
                out["error"] = f"could not write {self.output}: {e.strerror or e}"
        return out

    def _write(self, tensors: Dict[str, Dict[int, Any]]) -> None:
        """Write <capture_output_dir>/<output> through a temporary file in the same folder and os.replace."""
        from safetensors.torch import save_file

        assert self.output_dir is not None and self.output is not None
        flat: Dict[str, torch.Tensor] = {}
        for phase, layers in tensors.items():
            for layer, (t, keys) in layers.items():
                flat[f"{phase}.{layer}"] = t
                flat[f"{phase}.{layer}.positions"] = torch.tensor(keys, dtype=torch.int64)
        meta = {"kobold_backend.capture": json.dumps({"layers": sorted(self.layers), "positions": self.positions,
                                                      "phases": self.phases, "truncated": self.truncated})}
        fd, tmp = tempfile.mkstemp(prefix=f".{self.output}.", suffix=".tmp", dir=str(self.output_dir))
        os.close(fd)
        try:
            save_file(flat, tmp, metadata=meta)
            os.replace(tmp, str(self.output_dir / self.output))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def build_capture(params: Any, ctx: ActionContext) -> CaptureAction:
    """`{"layers": [..], "positions": "last"|"all", "phase": "prompt"|"generated"|[both], "dtype": "float16",
    "output": "name.safetensors"}`; checks the worst-case volume against the server's limit."""
    p = as_object(params, ctx, "", CAPTURE_KEYS)
    if "layers" not in p:
        raise ctx.error("needs 'layers': the decoder layers whose output to capture", ".layers")
    layers = as_layers(p["layers"], ctx, ".layers")
    positions = as_choice(p.get("positions", "last"), ctx, ".positions", POSITIONS)
    raw_phase = p.get("phase", ["prompt"])
    phase_list = raw_phase if isinstance(raw_phase, list) else [raw_phase]
    if not phase_list:
        raise ctx.error("must name at least one phase", ".phase")
    phases = [as_choice(v, ctx, ".phase", PHASES) for v in phase_list]
    phases = [ph for ph in PHASES if ph in phases]
    dtype = as_choice(p.get("dtype", "float16"), ctx, ".dtype", tuple(DTYPES))
    output: Optional[str] = None
    if "output" in p:
        output = check_file_name(as_string(p["output"], ctx, ".output"), ctx, ".output")
        if not output.endswith(".safetensors"):
            output += ".safetensors"
        folder = ctx.config.capture_output_dir
        if folder is None or not folder.is_dir():
            raise ctx.error("this server has no capture output folder configured", ".output")
        target = folder / output
        if target.is_symlink() or target.is_dir():
            raise ctx.error(f"{output!r} exists and is not a plain file", ".output")
    per_layer = 0
    if "prompt" in phases:
        per_layer += 1 if positions == "last" else (ctx.prompt_tokens or ctx.max_positions)
    if "generated" in phases:
        per_layer += ctx.max_new_tokens if ctx.max_new_tokens is not None else ctx.max_positions
    volume = per_layer * len(layers) * ctx.hidden_size
    limit = ctx.config.max_capture_values_file if output else ctx.config.max_capture_values_inline
    if volume > limit:
        where = "written to a file" if output else "returned in the response"
        raise ctx.error(f"may capture up to {volume} values ({len(layers)} layers x {per_layer} positions x "
                        f"{ctx.hidden_size}); at most {limit} may be {where} on this server")
    return CaptureAction(ctx, layers, positions, phases, dtype, output, limit)
