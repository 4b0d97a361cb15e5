"""What a model path must be (a model folder or a .gguf file) and, when it is not, one sentence saying what it is
and what is expected. No torch: the command line checks --model with it before importing torch, and
ModelConfig.from_dir with it before reading anything. A .gguf file is what the loader takes for one
(model_files.is_gguf_file), so the two never disagree."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from kobold_backend.engine.model_files import is_gguf_file
from kobold_backend.errors import ModelFormatError

EXPECTED = "a model folder (config.json and .safetensors files) or a .gguf file"


def model_path_problem(path: Union[str, Path]) -> Optional[str]:
    """None when `path` is a folder or a .gguf file, else the sentence that says what it is instead."""
    p = Path(path)
    try:
        if p.is_dir() or is_gguf_file(p):
            return None
    except ModelFormatError as exc:  # a FIFO, device or socket named .gguf: refused here as the loader would
        return str(exc)
    if not p.exists():
        return f"{p} does not exist; give {EXPECTED}."
    if p.is_file():
        kind = f"a {p.suffix} file" if p.suffix else "a file"
        return f"{p} is {kind}, not a model: give {EXPECTED}."
    return f"{p} is neither a folder nor a file; give {EXPECTED}."
