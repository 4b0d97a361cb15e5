"""What a model path must be (a model folder or a .gguf file) and, when it is not, one sentence saying what it is
and what is expected. Standard library only: the command line checks --model with it before importing torch, and
ModelConfig.from_dir with it before reading anything."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

EXPECTED = "a model folder (config.json and .safetensors files) or a .gguf file"


def model_path_problem(path: Union[str, Path]) -> Optional[str]:
    """None when `path` is a folder or a .gguf file, else the sentence that says what it is instead."""
    p = Path(path)
    if p.is_dir() or (p.suffix.lower() == ".gguf" and p.is_file()):
        return None
    if not p.exists():
        return f"{p} does not exist; give {EXPECTED}."
    if p.is_file():
        kind = f"a {p.suffix} file" if p.suffix else "a file"
        return f"{p} is {kind}, not a model: give {EXPECTED}."
    return f"{p} is neither a folder nor a file; give {EXPECTED}."
