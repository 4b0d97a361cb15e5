"""CPU threads (issue 35): the default is the physical cores, OpenMP waits passively, `--threads N` reaches torch
and the native CPU kernels through the engine; and, opt-in (a benchmark, not a timed CI test), decode on a machine
whose every core is busy keeps at least 0.4x its idle speed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from kobold_backend.engine import cpu_threads
from kobold_backend.ops import cpu_kernels, native
from tests.test_server_cli import REPO


def test_default_is_physical_cores_not_logical_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # four logical CPUs, two cores with two hyperthreads each: two threads
    cores = {0: ("0", "0"), 1: ("0", "1"), 2: ("0", "0"), 3: ("0", "1")}
    monkeypatch.setattr(cpu_threads, "_allowed_cpus", lambda: set(cores))
    monkeypatch.setattr(cpu_threads, "_core_of", cores.get)
    assert cpu_threads.default_threads() == 2
    # the affinity mask counts: a process pinned to one hyperthread of each core still gets two
    monkeypatch.setattr(cpu_threads, "_allowed_cpus", lambda: {2, 3})
    assert cpu_threads.default_threads() == 2
    monkeypatch.setattr(cpu_threads, "_allowed_cpus", lambda: {0, 2})
    assert cpu_threads.default_threads() == 1
    # no topology (not Linux): the logical CPUs
    monkeypatch.setattr(cpu_threads, "_allowed_cpus", lambda: set(range(6)))
    monkeypatch.setattr(cpu_threads, "_core_of", lambda cpu: None)
    assert cpu_threads.default_threads() == 6


def test_a_users_omp_num_threads_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads, "physical_cores", lambda: 8)
    for value, expected in (("1", 1), ("3,2", 3), ("", 8), ("zero", 8), ("0", 8)):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        assert cpu_threads.default_threads() == expected, value


def test_openmp_waits_passively_unless_the_user_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in cpu_threads.PASSIVE_WAIT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cpu_threads.prepare_environment()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and os.environ["GOMP_SPINCOUNT"] == "0"


def test_bad_thread_counts_are_refused() -> None:
    for bad in (0, -1, True, 1.5, "2", cpu_threads.MAX_THREADS + 1):
        with pytest.raises(ValueError, match="threads must be a whole number"):
            cpu_threads.apply_threads(bad)  # type: ignore[arg-type]


def test_applied_count_reaches_the_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = native.cpu_kernels()
    if kernels is None:
        pytest.skip("no native CPU kernels here")
    calls: List[Dict[str, Any]] = []
    real = cpu_kernels.call
    monkeypatch.setattr(cpu_kernels, "call",
                        lambda module, kernel, sig, **args: (calls.append(dict(args, kernel=kernel)),
                                                             real(module, kernel, sig, **args)))
    before = torch.get_num_threads()
    try:
        x, w = torch.randn(4, 64), torch.ones(64)
        for n in (1, 2):
            assert cpu_threads.apply_threads(n) == n == torch.get_num_threads()
            kernels.rms_norm(x, w, 1e-5)
            assert calls[-1]["kernel"] == "rms_norm" and calls[-1]["threads"] == n
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("flag", [["--threads", "1"], []], ids=["--threads 1", "default"])
def test_generate_applies_the_thread_count(checkpoints: Any, flag: List[str]) -> None:
    """The load log states torch's count after the engine applied it: the flag, else the default (the physical
    cores unless OMP_NUM_THREADS is set)."""
    model = checkpoints.get("gptq_v1_sym_g32").path
    proc = subprocess.run([sys.executable, "-m", "kobold_backend.cli", "generate", "--model", str(model), "--prompt",
                           "Hi", "--max-new-tokens", "2", "--device", "cpu", *flag], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    expected = int(flag[1]) if flag else cpu_threads.default_threads()
    assert f"CPU threads: {expected}\n" in proc.stderr, proc.stderr


@pytest.mark.skipif(os.environ.get("KOBOLD_BACKEND_CPU_CONTENTION") != "1",
                    reason="a benchmark of about a minute: set KOBOLD_BACKEND_CPU_CONTENTION=1")
def test_decode_on_busy_cores_keeps_four_tenths_of_idle(checkpoints: Any) -> None:
    sys.path.insert(0, str(REPO / "tools"))
    from cpu_contention import measure

    for model in (None, str(checkpoints.get("gptq_v1_sym_g32").path)):
        idle, busy = measure(model, runs=3, tokens=100, extra=[])
        assert busy >= 0.4 * idle, (Path(model or "demo").name, idle, busy)
