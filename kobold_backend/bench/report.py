"""docs/performance.md's format table from bench JSON: `python -m kobold_backend.bench.report FILE...` prints it.

Each FILE is one `kobold-backend bench --json` result or a merged file (`{"runs": [...]}`, written by
`--merge OUT`, e.g. docs/bench/h200-formats.json). One row per run and figure: this engine's tokens/s, then each
compared engine's (llama.cpp, exllamav2) and ours ÷ theirs (> 1: this engine is faster).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

OTHERS = (("llamacpp", "llama.cpp"), ("exllamav2", "exllamav2"))
FIGURES = (("prompt_tokens_per_s", "prompt"), ("decode_tokens_per_s", "decode ctx"))


def load_runs(paths: Iterable[Path]) -> List[Dict[str, Any]]:
    """Every run in the files, each with a `label` (its own, else the file name without .json)."""
    runs = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        for run in data["runs"] if "runs" in data else [data]:
            if "kobold_backend" not in run or "skipped" in run["kobold_backend"]:
                raise ValueError(f"{path} holds a run without this engine's figures")
            runs.append(dict(run, label=run.get("label") or Path(path).stem))
    return runs


def _rate(value: Optional[float]) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if value >= 1000 else f"{value:,.1f}"


def _ratio(ours: Optional[float], theirs: Optional[float]) -> str:
    return f"{ours / theirs:.2f}" if ours and theirs else "—"


def table(runs: Sequence[Dict[str, Any]]) -> str:
    """The markdown table: run, KV cache, figure, this engine, then tokens/s and ratio per compared engine."""
    others = [(key, name) for key, name in OTHERS if any(key in run for run in runs)]
    head = ["run", "KV cache", "figure", "this engine"]
    for _, name in others:
        head += [name, f"÷ {name}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        ours = run["kobold_backend"]
        for figure, words in FIGURES:
            for n, value in sorted(ours.get(figure, {}).items(), key=lambda kv: int(kv[0])):
                row = [run["label"], run.get("cache_dtype", "fp16"), f"{words} {int(n):,}", _rate(value)]
                for key, _ in others:
                    theirs = run.get(key, {}).get(figure, {}).get(n)
                    row += [_rate(theirs), _ratio(value, theirs)]
                lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def provenance(runs: Sequence[Dict[str, Any]]) -> str:
    """One line per distinct reference build: llama.cpp's commit and CMake flags, exllamav2's version, the GPU."""
    seen = []
    for run in runs:
        env = run.get("environment", {})
        line = f"GPU {env.get('gpu', '?')}, torch {env.get('torch', '?')}, kobold_backend {env.get('kobold_backend')}"
        lcpp = run.get("llamacpp", {})
        if "build_commit" in lcpp:
            build = lcpp.get("build", {})
            line += (f"; llama.cpp {build.get('commit', lcpp['build_commit'])} "
                     f"({' '.join(build.get('cmake_flags', [])) or 'CMake flags not recorded'})")
        if "version" in run.get("exllamav2", {}):
            line += f"; exllamav2 {run['exllamav2']['version']}"
        if line not in seen:
            seen.append(line)
    return "\n".join(f"- {line}" for line in seen)


def merged_ratios(runs: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Every run's `ratios` in one tree (reference -> variant -> figure -> size), as the issue's keys name them, e.g.
    `ratios.llamacpp.q4_k_m.decode_tokens_per_s.4000` or `ratios.llamacpp.q8.decode_tokens_per_s.16000`; a run's
    variant is its file type or cache dtype, so runs of one merged file do not overwrite each other's."""
    out: Dict[str, Any] = {}
    for run in runs:
        for reference, tree in run.get("ratios", {}).items():
            target = out.setdefault(reference, {})
            for variant, figures in tree.items():
                key = variant if variant not in target else f"{variant}:{run['label']}"
                target[key] = figures
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kobold_backend.bench.report",
                                     description="Print docs/performance.md's table from bench JSON files.")
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE", help="bench --json results or merged files")
    parser.add_argument("--merge", metavar="OUT", type=Path, default=None,
                        help="also write all runs as one JSON file (e.g. docs/bench/h200-formats.json)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.files if not p.is_file()]
    if missing:
        parser.error(f"{', '.join(missing)}: no such file")
    try:
        runs = load_runs(args.files)
    except (ValueError, KeyError, TypeError) as exc:
        parser.error(f"not bench JSON ({type(exc).__name__}: {exc})")
    if args.merge:
        args.merge.write_text(json.dumps({"ratios": merged_ratios(runs), "runs": runs}, indent=1) + "\n")
    sys.stdout.write(table(runs) + "\n\n" + provenance(runs) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
