"""open_gguf(path) -> the config, tokenizer and weight reader of a GGUF model, as a model folder would give them;
gguf_config(path) -> its config alone (for load planning and folder checks)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional, Tuple

from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.gguf.config import architecture, hf_config
from kobold_backend.engine.gguf.file import GGUFFile
from kobold_backend.engine.gguf.tokenizer_files import tokenizer_files
from kobold_backend.engine.gguf.weights import GGUFWeights
from kobold_backend.engine.model_files import is_gguf_file, open_model_file
from kobold_backend.engine.tokenizer import Tokenizer, load_tokenizer
from kobold_backend.errors import ModelFormatError


def gguf_config(path: Path) -> ModelConfig:
    """The ModelConfig of a GGUF file alone (metadata and the small RoPE tables; the file is closed after)."""
    return ModelConfig.from_dir(path)


def is_gguf(path: Path) -> bool:
    """A regular file named *.gguf that starts with GGUF's magic bytes (a FIFO or device of that name is never
    opened)."""
    try:
        if not is_gguf_file(path):
            return False
        with open_model_file(path) as fh:
            return fh.read(4) == b"GGUF"
    except (OSError, ModelFormatError):
        return False


def open_gguf(path: Path, with_tokenizer: bool = True) -> Tuple[ModelConfig, Optional[Tokenizer], GGUFWeights]:
    """Read a GGUF file's metadata (tensor data stays memory-mapped until the loader asks for it)."""
    gguf = GGUFFile(path)
    try:
        raw = hf_config(gguf.metadata, gguf.names(), path.name, gguf.floats)
        config = ModelConfig.from_dict(raw)
        tokenizer = None
        if with_tokenizer:
            with tempfile.TemporaryDirectory(prefix="kobold-gguf-tokenizer-") as tmp:
                for name, data in tokenizer_files(gguf.metadata, path.name).items():
                    (Path(tmp) / name).write_bytes(data)
                tokenizer = load_tokenizer(tmp, config.bos_token_id, config.eos_token_ids)
        arch = architecture(gguf.architecture, path.name, int(raw.get("num_local_experts") or 0))
        return config, tokenizer, GGUFWeights(gguf, arch, config.num_heads, config.num_kv_heads,
                                                 config.num_layers)
    except BaseException:
        gguf.close()  # a refused file's map is released now, not when the traceback goes
        raise
