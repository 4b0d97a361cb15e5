"""Random inputs and float64 oracles shared by the native-kernel tests (tests/test_ext_*.py)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from kobold_backend.ops import reference
from kobold_backend.ops.gptq_weight import GPTQWeight


def make_gptq(
    k: int,
    n: int,
    group_size: int,
    *,
    act_order: bool = False,
    dtype: torch.dtype = torch.float32,
    bias: bool = False,
    device: str = "cpu",
    seed: int = 0,
) -> GPTQWeight:
    """A GPTQWeight with random packed nibbles, scales, integer true zeros and (optionally) a permutation.

    group_size -1 means one group of K rows, as in the checkpoint format. When K is not a multiple of 8,
    the unused nibbles of the last packed row stay random, so a kernel that reads them is caught.
    """
    g = torch.Generator().manual_seed(seed)
    gs = k if group_size == -1 else group_size
    groups = -(-k // gs)
    rows = -(-k // 8)
    qweight = torch.randint(-(2**31), 2**31 - 1, (rows, n), generator=g, dtype=torch.int64).to(torch.int32)
    scales = torch.rand(groups, n, generator=g, dtype=torch.float64) * 0.02 + 0.002
    zeros = torch.randint(0, 16, (groups, n), generator=g).to(torch.float64)
    perm = torch.randperm(k, generator=g) if act_order else None
    b = (torch.randn(n, generator=g, dtype=torch.float64) * 0.1).to(dtype) if bias else None
    return GPTQWeight(
        qweight=qweight.to(device),
        scales=scales.to(dtype).to(device),
        zeros=zeros.to(dtype).to(device),
        perm=None if perm is None else perm.to(device),
        group_size=gs,
        in_features=k,
        out_features=n,
        bias=None if b is None else b.to(device),
    )


def as_float64(w: GPTQWeight) -> GPTQWeight:
    """The same layer with scales, zeros and bias in float64 on the CPU (for an exact-ish oracle)."""
    return GPTQWeight(
        qweight=w.qweight.cpu(),
        scales=w.scales.cpu().double(),
        zeros=w.zeros.cpu().double(),
        perm=None if w.perm is None else w.perm.cpu(),
        group_size=w.group_size,
        in_features=w.in_features,
        out_features=w.out_features,
        bias=None if w.bias is None else w.bias.cpu().double(),
    )


def gptq_oracle(x: torch.Tensor, w: GPTQWeight) -> torch.Tensor:
    """reference.gptq_matmul evaluated in float64 on the CPU."""
    return reference.gptq_matmul(x.cpu().double(), as_float64(w))


def rope_tables(positions: int, head_dim: int, theta: float = 10000.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [positions, head_dim] in float64, rotate-half layout (the Llama formula)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float64), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def poisoned(shape: Tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    """No NaN/inf in `actual`, and max |actual - expected| <= tol * max |expected| (plus a tiny floor)."""
    a = actual.detach().cpu().double()
    e = expected.detach().cpu().double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{what}: output has NaN/inf (a poisoned element was not written?)"
    scale = float(e.abs().max()) if e.numel() else 0.0
    err = float((a - e).abs().max()) if e.numel() else 0.0
    assert err <= tol * scale + 1e-30, f"{what}: max error {err:.3e} > {tol:.1e} x {scale:.3e}"


def tol_for(dtype: torch.dtype) -> float:
    """Relative tolerance of one rounding-to-dtype plus fp32 accumulation differences."""
    return {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}[dtype]


def random(shape: Tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0,
           device: Optional[str] = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    return t if device is None else t.to(device)
