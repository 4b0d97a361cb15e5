"""`python -m kobold_backend.bench ...`: the bench without the rest of the CLI."""

from __future__ import annotations

import argparse
import logging
import sys

from kobold_backend.bench import add_bench_parser, run_bench


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m kobold_backend.bench")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return run_bench(parser.parse_args(["bench"] + sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
