"""What the CPU and CUDA wrappers share when they hand tensors to the compiled kernels: dtype codes, output
allocation, row views, the GPTQWeight layout check, the shape tests that decide native vs reference, and
`call`, which passes a kernel's arguments by name in the order its pybind11 binding declares them.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch

DTYPE_CODES: Dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
GEMV_MAX_ROWS = 8  # rows of x the GEMV kernels take; more go through dequantize + matmul


def call(module: Any, kernel: str, signatures: Mapping[str, Tuple[str, ...]], **args: Any) -> None:
    """`module.kernel(...)` with `args` given by name and passed positionally in the binding's order
    (`signatures[kernel]`, the parameter names of csrc/*/module_*.cpp; tests/test_ext_bindings.py checks the
    tables against the sources), so Python reads name=value and any build of the bindings accepts the call."""
    names = signatures[kernel]
    try:
        values = [args[name] for name in names]
    except KeyError as exc:
        raise TypeError(f"{kernel}() needs the argument {exc.args[0]!r}") from None
    if len(args) != len(names):
        extra = sorted(set(args) - set(names))
        raise TypeError(f"{kernel}() takes no argument {', '.join(map(repr, extra))}")
    getattr(module, kernel)(*values)


def out_tensor(out: Optional[torch.Tensor], shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A new tensor of `shape` like `like`, or `out` after checking it has that shape, dtype and device."""
    if out is None:
        return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"out must be {like.dtype} {tuple(shape)} on {like.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    return out


def rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, last] view whose last dimension is contiguous (copying only when it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _no_tensor() -> None:
    return None


def _ref(t: Optional[torch.Tensor]) -> Any:
    return _no_tensor if t is None else weakref.ref(t)


# id(GPTQWeight) -> weak references to it and its tensors, plus the device and sizes it was checked for.
_GPTQ_CHECKED: Dict[int, Tuple[Any, ...]] = {}


def check_gptq(w: Any, device: torch.device) -> None:
    """Shapes, dtypes and devices the kernels rely on (raising here avoids reading out of bounds).

    The result is remembered per weight object and its tensors, so a decode step pays a few identity tests.
    """
    entry = _GPTQ_CHECKED.get(id(w))
    if (entry is not None and entry[0]() is w and entry[1]() is w.qweight and entry[2]() is w.scales
            and entry[3]() is w.zeros and entry[4]() is w.perm and entry[5]() is w.bias and entry[6] == device
            and entry[7] == (w.in_features, w.out_features, w.group_size)):
        return
    k, n, gs = w.in_features, w.out_features, w.group_size
    groups = -(-k // gs) if gs > 0 else 0
    problems = []
    if gs <= 0:
        problems.append(f"group_size {gs}")
    if w.qweight.dtype != torch.int32 or tuple(w.qweight.shape) != (-(-k // 8), n) or not w.qweight.is_contiguous():
        problems.append(f"qweight {w.qweight.dtype} {tuple(w.qweight.shape)}")
    for name in ("scales", "zeros"):
        t = getattr(w, name)
        if tuple(t.shape) != (groups, n) or not t.is_contiguous():
            problems.append(f"{name} {tuple(t.shape)}")
    if w.perm is not None and (w.perm.dtype != torch.int64 or tuple(w.perm.shape) != (k,)
                               or not w.perm.is_contiguous()):
        problems.append(f"perm {w.perm.dtype} {tuple(w.perm.shape)}")
    if w.bias is not None and (tuple(w.bias.shape) != (n,) or not w.bias.is_contiguous()):
        problems.append(f"bias {tuple(w.bias.shape)}")
    tensors = [w.qweight, w.scales, w.zeros, w.perm, w.bias]
    if any(t is not None and t.device != device for t in tensors):
        problems.append(f"tensors not all on {device}")
    if problems:
        raise ValueError(f"malformed GPTQWeight [{k}x{n}, group {gs}]: " + ", ".join(problems))
    if len(_GPTQ_CHECKED) > 100_000:
        _GPTQ_CHECKED.clear()
    _GPTQ_CHECKED[id(w)] = (weakref.ref(w), _ref(w.qweight), _ref(w.scales), _ref(w.zeros), _ref(w.perm),
                            _ref(w.bias), device, (k, n, gs))


def rope_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, codes: Dict[torch.dtype, int]) -> bool:
    if q.dim() != 4 or k.dim() != 4 or k_cache.dim() != 4:
        return False
    b, t, _, d = q.shape
    hkv = k.shape[2]
    return (
        q.dtype in codes and all(x.dtype == q.dtype for x in (k, v, k_cache, v_cache))
        and cos.dtype in (torch.float32, q.dtype) and sin.dtype == cos.dtype
        and tuple(k.shape) == (b, t, hkv, d) and tuple(v.shape) == (b, t, hkv, d)
        and k_cache.shape[0] == b and k_cache.shape[1] == hkv and k_cache.shape[3] == d
        and v_cache.shape == k_cache.shape and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        and cos.dim() == 2 and cos.shape[1] == d and sin.shape == cos.shape
        and cos.stride(-1) == 1 and sin.stride(-1) == 1 and d % 2 == 0
    )


def check_rope_range(pos: int, t: int, cache_len: int, cos_len: int, sin_len: int) -> None:
    if pos < 0 or pos + t > min(cache_len, cos_len, sin_len):
        raise ValueError(f"positions {pos}..{pos + t - 1} fall outside the cache ({cache_len}) or the RoPE "
                         f"tables ({cos_len})")


def attention_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len: int,
                        codes: Dict[torch.dtype, int]) -> bool:
    if q.dim() != 3 or k_cache.dim() != 4:
        return False
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    if not (q.dtype in codes and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
            and k_cache.shape[0] == b and k_cache.shape[3] == d and v_cache.shape == k_cache.shape
            and hkv > 0 and hq % hkv == 0 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1):
        return False
    if not 1 <= seq_len <= k_cache.shape[2]:
        raise ValueError(f"seq_len {seq_len} is outside 1..{k_cache.shape[2]} (the cache length)")
    return True
