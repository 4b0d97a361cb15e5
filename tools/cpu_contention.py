"""CPU decode speed with the cores idle and with every core busy: `kobold-backend generate` on a model, first alone,
then beside one busy-loop process per logical CPU (the "another job on the machine" case of issue 35), repeated,
the median of each. The figures of docs/performance.md ("CPU: decode on a busy machine") come from here.

    python tools/cpu_contention.py [--model PATH] [--runs 3] [--tokens 100] [--root DIR] [-- extra generate flags]

--root runs the `kobold_backend` of another checkout (e.g. `git archive` of an earlier commit, with this one's
compiled `_ext_cpu` copied in) with this environment's Python, for a before/after comparison on the same machine.

Without --model: the built-in demo model, then the GPTQ fixture gptq_v1_sym_g32 of tests/fixtures/checkpoints.py
(built in a temporary folder). Each line: the model, the flags, idle and busy tokens/s (medians; the slowest busy
run too, since a collapse comes and goes with the rest of the machine's load), and busy / idle.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
RATE = re.compile(r"new tokens at ([0-9.]+) tokens/s")
HOG = "while True: pass"


def decode_rate(model: Optional[str], tokens: int, extra: List[str], root: Path = ROOT) -> float:
    """Tokens/s of one `kobold-backend generate` run (a seed whose continuation does not stop early)."""
    cmd = [sys.executable, "-m", "kobold_backend.cli", "generate", "--prompt", "Once upon a time", "--seed", "1",
           "--max-new-tokens", str(tokens), *(["--model", model] if model else []), *extra]
    env = dict(os.environ, PYTHONPATH=str(root))  # before an editable install's path hook
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(root), env=env, timeout=600)
    found = RATE.search(proc.stderr)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr[-800:]}")
    return float(found.group(1))


def busy(count: int) -> List[subprocess.Popen]:
    """`count` processes that each keep one CPU busy until killed."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(count)]
    time.sleep(0.5)
    return hogs


def rates(model: Optional[str], runs: int, tokens: int, extra: List[str], root: Path = ROOT
          ) -> Tuple[List[float], List[float]]:
    """Tokens/s of each run idle and busy, the runs interleaved so that a change in the machine's load hits both."""
    idle, loaded = [], []
    for _ in range(runs):
        idle.append(decode_rate(model, tokens, extra, root))
        hogs = busy(os.cpu_count() or 1)
        try:
            loaded.append(decode_rate(model, tokens, extra, root))
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
    return idle, loaded


def measure(model: Optional[str], runs: int, tokens: int, extra: List[str], root: Path = ROOT) -> Tuple[float, float]:
    """(idle, busy) median tokens/s."""
    idle, loaded = rates(model, runs, tokens, extra, root)
    return statistics.median(idle), statistics.median(loaded)


def fixture_model(root: Path) -> str:
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.checkpoints import CheckpointFactory

    return str(CheckpointFactory(root).get("gptq_v1_sym_g32").path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder or .gguf file (default: demo + fixture)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose kobold_backend runs")
    parser.add_argument("extra", nargs="*", help="more `generate` flags, after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = [args.model] if args.model else [None, fixture_model(Path(tmp))]
        for model in models:
            idle, loaded = rates(model, args.runs, args.tokens, args.extra, args.root)
            mid_idle, mid_busy = statistics.median(idle), statistics.median(loaded)
            name = Path(model).name if model else "demo"
            print(f"{name} {' '.join(args.extra) or '(default threads)'}: idle {mid_idle:.1f} tok/s, "
                  f"{os.cpu_count()} busy loops {mid_busy:.1f} tok/s (slowest {min(loaded):.1f}), busy/idle "
                  f"{mid_busy / mid_idle:.2f} (slowest {min(loaded) / mid_idle:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
