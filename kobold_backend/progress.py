"""Progress callbacks `(done, total, message)` as load_model and the demo builder call them; the one here draws
a bar on stderr for the command line (results stay on stdout)."""

from __future__ import annotations

import sys
from typing import Callable


def stderr_progress(prefix: str) -> Callable[[int, int, str], None]:
    """A progress callback that redraws one line on stderr."""

    def report(done: int, total: int, message: str) -> None:
        width = 30
        filled = int(width * done / max(total, 1))
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r{prefix} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {message:<24}{end}")
        sys.stderr.flush()

    return report
