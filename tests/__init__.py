"""The test suite (a package so that `tests.fixtures` and `kobold_backend` import from the repository root).

Imported before conftest.py and so before anything loads torch or a kernel module, which is when an OpenMP runtime
reads its settings: threads that wait for work sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE). The suite runs
tiny models on a shared 2-core machine; with spinning waiters every parallel region also waits for a peer thread
that another process has descheduled, which made the demo model's sampling tests 20-40x slower under load
(docs/testing.md). The thread count itself is untouched, so the kernels' parallel paths are still exercised.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
