"""How many threads the CPU work uses, decided and applied in one place: torch's intra-op pool and the native CPU
kernels (kobold_backend/ops/cpu_kernels.py passes torch's count to every kernel call, fewer for small work).

The default is OMP_NUM_THREADS where the user set it, else the number of physical cores this process may run on
(not logical CPUs: two hyperthreads of one core only contend for it). OpenMP threads that wait at a barrier sleep
instead of spinning (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=0): on a machine whose cores are busy with other work,
a spinning thread burns the time slice the thread it waits for needs, and decode collapses (docs/performance.md,
"CPU: decode on busy cores"). Both OpenMP runtimes in the process read these variables once, when they start:
torch's at `import torch` (so the command line calls `prepare_environment()` before importing torch) and the one of
the compiled CPU kernels when they are first loaded. A variable the user already set is kept. This module imports
torch only inside `apply_threads`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Set, Tuple

# Set before an OpenMP runtime starts, unless already set: waiting threads sleep instead of spinning.
PASSIVE_WAIT = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}
MAX_THREADS = 1024


def prepare_environment() -> None:
    """Make OpenMP threads wait passively in every runtime that starts from now on (user settings are kept)."""
    for name, value in PASSIVE_WAIT.items():
        os.environ.setdefault(name, value)


def _allowed_cpus() -> Set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _core_of(cpu: int) -> Optional[Tuple[str, str]]:
    """(package id, core id) of a logical CPU from Linux's sysfs; None where that is not readable."""
    topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
    except OSError:
        return None


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (its affinity mask): hyperthread siblings count once.
    Where the topology is unknown (not Linux), the logical CPU count."""
    cpus = _allowed_cpus()
    cores = {_core_of(cpu) for cpu in cpus}
    if None in cores:
        return max(1, len(cpus))
    return max(1, len(cores))


def default_threads() -> int:
    """The thread count when none is asked for: OMP_NUM_THREADS when the user set it (its first level), else the
    physical cores this process may use."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if first.isdigit() and 1 <= int(first) <= MAX_THREADS:
        return int(first)
    return physical_cores()


def check_threads(threads: Optional[int]) -> Optional[int]:
    """`threads` when None (the default) or a whole number from 1 to MAX_THREADS; ValueError otherwise."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be a whole number from 1 to {MAX_THREADS}, not {threads!r}")
    return threads


def apply_threads(threads: Optional[int] = None) -> int:
    """Use `threads` CPU threads (default: the physical cores) in torch and the native CPU kernels; returns torch's
    count after applying it (what every kernel call then gets)."""
    import torch

    n = check_threads(threads) or default_threads()
    prepare_environment()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return torch.get_num_threads()
