"""Opening a model's files: every file of a model folder or a .gguf file is proved to be a regular file before it is
opened, and read whole only below a size bound.

A FIFO blocks open() until a writer comes (the whole process with it: SIGTERM waits on the same call), a device
reads without end, a socket or a folder cannot be read as a file. Each is refused with one sentence naming the file
(ModelFormatError), before anything opens it; the descriptor is checked again once open (O_NONBLOCK: opening a FIFO
that appeared in between cannot block either).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO, List, Union

from kobold_backend.errors import ModelFormatError

PathLike = Union[str, Path]

# What a model's JSON files (config.json, generation_config.json, the shard index, tokenizer_config.json, ...) and
# its chat_template.jinja may weigh when read whole: real ones are below a few MB (a 600-shard index: ~10 MB).
MAX_JSON_BYTES = 64 << 20
# tokenizer.json and tokenizer.model: the largest real ones (256k-token vocabularies) are about 35 MB.
MAX_TOKENIZER_BYTES = 256 << 20

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def _not_regular(path: Path, mode: int) -> ModelFormatError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return ModelFormatError(f"{path.name} is {kind}, not a regular file; a model's files must be regular files.")


def is_model_file(path: PathLike) -> bool:
    """True for a regular file (after symbolic links), False when nothing is there; a FIFO, device, socket or
    folder in its place, or a path that cannot be looked at, is a ModelFormatError naming it."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    except (OSError, ValueError) as exc:  # a link loop, no permission, a NUL in the name
        raise ModelFormatError(f"{path.name} could not be looked at ({getattr(exc, 'strerror', None) or exc}).") \
            from None
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode)
    return True


def check_model_file(path: PathLike) -> Path:
    """`path` when it is a regular file; a missing or special file is one sentence naming it."""
    path = Path(path)
    if not is_model_file(path):
        raise ModelFormatError(f"{path.name} does not exist in {path.parent.name or '.'}.")
    return path


def open_model_file(path: PathLike) -> BinaryIO:
    """The regular file `path` opened for reading in binary (the caller closes it)."""
    path = check_model_file(path)
    try:
        fd = os.open(str(path), _OPEN_FLAGS)
    except OSError as exc:
        raise ModelFormatError(f"{path.name} could not be opened ({exc.strerror or exc}).") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_model_bytes(path: PathLike, limit: int = MAX_JSON_BYTES) -> bytes:
    """The whole regular file `path`, refused with one sentence when it is larger than `limit` bytes."""
    with open_model_file(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        data = fh.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:
            raise ModelFormatError(f"{Path(path).name} is larger than {limit >> 20} MB; no model's file of this "
                                   "kind is that large.")
        return data


def read_model_text(path: PathLike, limit: int = MAX_JSON_BYTES) -> str:
    """The whole regular file `path` as UTF-8 text (bounded as read_model_bytes)."""
    try:
        return read_model_bytes(path, limit).decode("utf-8")
    except UnicodeDecodeError:
        raise ModelFormatError(f"{Path(path).name} is not UTF-8 text.") from None


def model_files(folder: PathLike, pattern: str) -> List[Path]:
    """The entries of `folder` matching `pattern`, sorted; a special file among them is refused (is_model_file)."""
    found = sorted(Path(folder).glob(pattern))
    for path in found:
        is_model_file(path)
    return found


def is_gguf_file(path: PathLike) -> bool:
    """True when `path` names a .gguf file (a regular file; a special file of that name is refused)."""
    path = Path(path)
    return path.suffix == ".gguf" and not path.is_dir() and is_model_file(path)
