"""Gated DeltaNet linear attention (Qwen3.5's linear layers): a token mixer whose memory is a fixed-size state.

Per layer the cache keeps a `LinearState`: the last `kernel - 1` inputs of the causal depthwise conv1d over q/k/v,
and the recurrent state S [batch, value_heads, key_dim, value_dim] in float32. Per token t (q, k L2-normed, q also
scaled by key_dim ** -0.5; beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias), the log of the decay):

    S <- exp(g) * S;   u = beta * (v - S^T k);   S <- S + k u^T;   o = S^T q

and the output is RMSNorm(o) * weight * silu(z), projected by out_proj. Each key head serves value_heads / key_heads
value heads: consecutive ones as Hugging Face stores them, or every key_heads-th one ("tiled", as llama.cpp's
converter reorders them for ggml's broadcast). A prompt chunk runs the same recurrence in
blocks of CHUNK tokens (the intra-block part solved as one unit-lower-triangular system), a decode step token by
token. The state cannot be cut back to an earlier position; engine/cache.py keeps snapshots for that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Tuple

import torch
import torch.nn.functional as F

from kobold_backend.engine.model import Weight, project

CHUNK = 64


@dataclass
class LinearState:
    """One linear layer's state in the cache: conv [B, channels, kernel - 1] (layer dtype), recurrent
    [B, value_heads, key_dim, value_dim] (float32)."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    def zero_(self) -> None:
        self.conv.zero_()
        self.recurrent.zero_()

    def copy_(self, other: LinearState) -> None:
        self.conv.copy_(other.conv)
        self.recurrent.copy_(other.recurrent)

    def clone(self) -> LinearState:
        return LinearState(self.conv.clone(), self.recurrent.clone())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
    """The recurrence token by token. q, k [B, H, T, dk], v [B, H, T, dv], g, beta [B, H, T], all float32;
    `state` [B, H, dk, dv] is updated in place; returns o [B, H, T, dv]."""
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        state.mul_(g[:, :, t].exp()[..., None, None])
        u = (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])) * beta[:, :, t, None]
        state.add_(k[:, :, t, :, None] * u[:, :, None, :])
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, :, t])
    return out


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The same recurrence in blocks of `chunk` tokens (same shapes as delta_rule_steps).

    Within a block with cumulative log decay G (G_t = g_1 + ... + g_t) and starting state S0, the corrections u
    solve (I + A) u = beta v - beta exp(G) K S0 with A[t, s] = beta_t exp(G_t - G_s) k_t.k_s for s < t; then
    o_t = exp(G_t) S0^T q_t + sum_{s <= t} exp(G_t - G_s) (q_t.k_s) u_s and
    S = exp(G_T) S0 + sum_s exp(G_T - G_s) k_s u_s^T.
    """
    t = k.shape[2]
    out = torch.empty_like(v)
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(0)  # s >= t: not in A
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # s > t: not in o
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    for start in range(0, t, chunk):
        end = min(start + chunk, t)
        n = end - start
        qc, kc, vc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        bc = beta[:, :, start:end, None]
        cum = g[:, :, start:end].cumsum(-1)
        diff = cum[..., :, None] - cum[..., None, :]  # G_t - G_s
        decay = diff.masked_fill(causal[:n, :n], float("-inf")).exp()
        a = ((bc * kc) @ kc.transpose(-1, -2) * decay).masked_fill(strict[:n, :n], 0.0)
        rhs = torch.cat([bc * vc, bc * cum.exp()[..., None] * kc], dim=-1)
        solved = torch.linalg.solve_triangular(a + eye[:n, :n], rhs, upper=False, unitriangular=True)
        u = solved[..., : v.shape[-1]] - solved[..., v.shape[-1]:] @ state
        out[:, :, start:end] = (cum.exp()[..., None] * qc) @ state + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        last = cum[..., -1:]
        state.mul_(last.exp()[..., None]).add_((kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ u)
    return out


class GatedDeltaNet:
    """One linear-attention token mixer: `mixer(x, cache, index, pos)` maps the normed hidden state [B, T, H] to
    the layer's mixer output [B, T, H], reading and advancing `cache.states[index]`."""

    def __init__(self, in_qkv: Weight, in_z: Weight, in_b: Weight, in_a: Weight, conv: torch.Tensor,
                 dt_bias: torch.Tensor, a_log: torch.Tensor, norm: torch.Tensor, out: Weight, key_heads: int,
                 value_heads: int, key_dim: int, value_dim: int, eps: float, tiled: bool = False) -> None:
        self.in_qkv, self.in_z, self.in_b, self.in_a, self.out = in_qkv, in_z, in_b, in_a, out
        self.conv = conv  # [channels, kernel]
        self.dt_bias = dt_bias.float()
        self.neg_a = -a_log.float().exp()
        self.norm = norm
        self.key_heads, self.value_heads = key_heads, value_heads
        self.key_dim, self.value_dim = key_dim, value_dim
        self.eps = eps
        self.tiled = tiled

    def new_state(self, batch: int) -> LinearState:
        channels, kernel = self.conv.shape
        return LinearState(
            torch.zeros((batch, channels, kernel - 1), dtype=self.conv.dtype, device=self.conv.device),
            torch.zeros((batch, self.value_heads, self.key_dim, self.value_dim), dtype=torch.float32,
                        device=self.conv.device))

    def tensors(self) -> Iterator[Any]:
        yield from (self.in_qkv, self.in_z, self.in_b, self.in_a, self.out, self.conv, self.dt_bias, self.neg_a,
                    self.norm)

    def _inputs(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q|k|v [B, T, channels] in the conv's channel order, z [B, T, value_heads * value_dim], the beta and
        decay projections b, a [B, T, value_heads])."""
        return project(x, self.in_qkv), project(x, self.in_z), project(x, self.in_b), project(x, self.in_a)

    def __call__(self, x: torch.Tensor, cache: Any, index: int, pos: int) -> torch.Tensor:
        state: LinearState = cache.states[index]
        b, t, _ = x.shape
        mixed, z, in_b, in_a = self._inputs(x)
        qkv = self._conv(mixed, state)
        kd, vd = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        q, k, v = qkv.float().split([kd, kd, vd], dim=-1)
        q = self._per_value_head(l2norm(q.view(b, t, self.key_heads, self.key_dim)))
        k = self._per_value_head(l2norm(k.view(b, t, self.key_heads, self.key_dim)))
        v = v.view(b, t, self.value_heads, self.value_dim)
        beta = torch.sigmoid(in_b.float())
        g = self.neg_a * F.softplus(in_a.float() + self.dt_bias)
        q, k, v = (y.transpose(1, 2) for y in (q * self.key_dim ** -0.5, k, v))
        rule = delta_rule_steps if t == 1 else delta_rule_chunked
        o = rule(q, k, v, g.transpose(1, 2), beta.transpose(1, 2), state.recurrent).transpose(1, 2)
        z = z.view(b, t, self.value_heads, self.value_dim)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        o = (self.norm * o.to(x.dtype)) * F.silu(z.float())
        return project(o.to(x.dtype).reshape(b, t, vd), self.out)

    def _per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, key_heads, D] -> [B, T, value_heads, D]: each value head's key head."""
        rep = self.value_heads // self.key_heads
        return x.repeat(1, 1, rep, 1) if self.tiled else x.repeat_interleave(rep, dim=2)

    def _conv(self, qkv: torch.Tensor, state: LinearState) -> torch.Tensor:
        """The causal depthwise conv1d (then SiLU) over [B, T, C], continuing from and updating the conv state."""
        window = torch.cat([state.conv, qkv.transpose(1, 2).to(state.conv.dtype)], dim=-1)
        state.conv.copy_(window[:, :, -state.conv.shape[-1]:])
        y = F.conv1d(window, self.conv.unsqueeze(1), groups=self.conv.shape[0])
        return F.silu(y).transpose(1, 2)



class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's layout of the same mixer: `in_qkvz` holds, per key head, its q, k, the v of its value heads and
    their z; `in_ba` per key head the b then the a of its value heads (unfused here, per token, for any weight
    format). `in_qkv` is the fused qkvz weight and `in_z` / `in_a` are unused (None); `in_b` is the fused ba."""

    def _inputs(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        rep = self.value_heads // self.key_heads
        dk, vd = self.key_dim, rep * self.value_dim
        qkvz = project(x, self.in_qkv).view(b, t, self.key_heads, 2 * dk + 2 * vd)
        q, k, v, z = qkvz.split([dk, dk, vd, vd], dim=-1)
        ba = project(x, self.in_b).view(b, t, self.key_heads, 2 * rep)
        flat = [y.reshape(b, t, -1) for y in (q, k, v)]
        return torch.cat(flat, dim=-1), z.reshape(b, t, -1), ba[..., :rep].reshape(b, t, -1), \
            ba[..., rep:].reshape(b, t, -1)

    def tensors(self) -> Iterator[Any]:
        yield from (self.in_qkv, self.in_b, self.out, self.conv, self.dt_bias, self.neg_a, self.norm)
