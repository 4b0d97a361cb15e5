"""Progress callbacks `(done, total, message)` as load_model and the demo builder call them; the one here draws
a bar on stderr for the command line (results stay on stdout), or writes plain lines where stderr is not a
terminal (a log file, a pipe), where a bar redrawn with carriage returns would pile up on one line."""

from __future__ import annotations

import sys
from typing import Callable


def stderr_progress(prefix: str) -> Callable[[int, int, str], None]:
    """A progress callback: a bar redrawn on one line of a terminal, else a line per tenth of the work and one at
    the end."""
    shown = [-1]

    def report(done: int, total: int, message: str) -> None:
        total = max(total, 1)
        if not sys.stderr.isatty():
            tenth = min(10, 10 * done // total)
            if tenth != shown[0] or done >= total:
                shown[0] = tenth
                sys.stderr.write(f"{prefix}: {done}/{total} {message}\n")
                sys.stderr.flush()
            return
        width = 30
        filled = int(width * done / total)
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r{prefix} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {message:<24}{end}")
        sys.stderr.flush()

    return report
