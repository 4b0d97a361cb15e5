"""The integer GGML GEMV's per-type step decoders (csrc/cuda/ggml_q8.cu `Loader<T>`) against ggml_blocks.h's
decode8, on the host, without a GPU: tests/fixtures/ggml_q8_steps.cu is compiled with nvcc (skipped where there is
none) and run; every block type's steps, and the re-laid-out Q8_0 / Q4_0 / Q6_K rows' (`Repacked<T>`), must cover
each element once with decode8's value."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kobold_backend.ops.build import find_nvcc

ROOT = Path(__file__).resolve().parent.parent
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0R", "Q4_0R", "Q6_KR")


@pytest.mark.slow
def test_q8_step_decoders_equal_decode8(tmp_path: Path) -> None:
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc to build the host check")
    exe = tmp_path / "ggml_q8_steps"
    subprocess.run([nvcc, "-O1", "-std=c++17", "-arch=sm_75", "-DKB_VERSION=\"test\"",
                    f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc' / 'cuda'}",
                    str(ROOT / "tests" / "fixtures" / "ggml_q8_steps.cu"), "-o", str(exe)], check=True, timeout=600)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.stdout.split("\n")[:len(TYPES)] == [f"{t} ok" for t in TYPES], run.stdout
    assert run.returncode == 0
