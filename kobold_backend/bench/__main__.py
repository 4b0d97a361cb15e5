"""`python -m kobold_backend.bench ...`: the bench without the rest of the CLI."""

from __future__ import annotations

import logging
import sys

from kobold_backend.bench import add_bench_parser, run_bench
from kobold_backend.errors import KoboldBackendError
from kobold_backend.flag_types import ArgumentParser, HelpFormatter

log = logging.getLogger("kobold_backend")


def main() -> int:
    """Parse the bench's flags (usage errors: one line, exit 2) and run it; a refused input is one line, exit 1."""
    parser = ArgumentParser(prog="python -m kobold_backend.bench")
    bench = add_bench_parser(parser.add_subparsers(dest="command", required=True))
    bench.prog, bench.formatter_class = parser.prog, HelpFormatter
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return run_bench(parser.parse_args(["bench"] + sys.argv[1:]))
    except KoboldBackendError as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
