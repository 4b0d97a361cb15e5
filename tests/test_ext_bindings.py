"""The kernel wrappers call each compiled kernel by parameter name (ops/marshal.call); the names and their order
must be the binding's own. Oracle: the lambda parameter lists in csrc/*/module_*.cpp, read from the source."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from kobold_backend.ops.cpu_kernels import CPU_SIGNATURES
from kobold_backend.ops.cuda_kernels import CUDA_SIGNATURES
from kobold_backend.ops.marshal import call

CSRC = Path(__file__).resolve().parent.parent / "csrc"
BINDING = re.compile(r'm\.def\(\s*"(\w+)",\s*\[\]\(([^)]*)\)', re.S)


def bound_parameters(source: Path) -> Dict[str, Tuple[str, ...]]:
    """kernel name -> the parameter names of its pybind11 lambda, in order."""
    out: Dict[str, Tuple[str, ...]] = {}
    for name, params in BINDING.findall(source.read_text(encoding="utf-8")):
        out[name] = tuple(p.split()[-1] for p in params.split(",") if p.strip())
    return out


@pytest.mark.parametrize("source, table", [("cpu/module_cpu.cpp", CPU_SIGNATURES),
                                           ("cuda/module_cuda.cpp", CUDA_SIGNATURES)])
def test_signature_tables_match_the_bindings(source: str, table: Dict[str, Tuple[str, ...]]) -> None:
    bound = bound_parameters(CSRC / source)
    assert set(table) <= set(bound)
    for kernel, names in table.items():
        assert names == bound[kernel], kernel


def test_call_orders_named_arguments_and_refuses_wrong_names() -> None:
    seen: List[Tuple[int, ...]] = []

    class Module:
        def kern(self, *args: int) -> None:
            seen.append(args)

    table = {"kern": ("a", "b", "c")}
    call(Module(), "kern", table, c=3, a=1, b=2)
    assert seen == [(1, 2, 3)]
    with pytest.raises(TypeError, match="needs the argument 'b'"):
        call(Module(), "kern", table, a=1, c=3)
    with pytest.raises(TypeError, match="takes no argument 'd'"):
        call(Module(), "kern", table, a=1, b=2, c=3, d=4)
