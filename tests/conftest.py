"""Shared fixtures: tokenizers and tiny checkpoints built once per test session under one temporary folder, and a
KoboldAI United checkout for the plugin tests. Every cache a test could read or fill points into a folder made for
this session (pytest_configure), so no run depends on what an earlier one left behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Iterator, Optional

import pytest

from kobold_backend import __version__
from kobold_backend.host.settings import PLUGIN_FOLDER
from kobold_backend.host.shim import write_shim
from tests.fixtures.checkpoints import CheckpointFactory
from tests.fixtures.tokenizers import write_byte_bpe, write_sentencepiece
from tests.united_harness import UnitedHost


@pytest.fixture(scope="session")
def fixture_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kobold_fixtures")


@pytest.fixture(scope="session")
def checkpoints(fixture_root: Path) -> CheckpointFactory:
    """`checkpoints.get(name)` builds the named fixture from tests/fixtures/checkpoints.py on first use."""
    return CheckpointFactory(fixture_root / "models")


@pytest.fixture(scope="session")
def spm_dir(fixture_root: Path) -> Path:
    """A folder with only the sentencepiece tokenizer (tokenizer.model + tokenizer_config.json)."""
    folder = fixture_root / "tokenizer-spm"
    write_sentencepiece(folder)
    return folder


@pytest.fixture(scope="session")
def bpe_dir(fixture_root: Path) -> Path:
    """A folder with only the byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json)."""
    folder = fixture_root / "tokenizer-bpe"
    write_byte_bpe(folder)
    return folder


@pytest.fixture
def united(tmp_path: Path) -> Iterator[UnitedHost]:
    """A KoboldAI United checkout laid out in tmp_path with this plugin's class.py shim, discovered."""
    host = UnitedHost(tmp_path / "KoboldAI")
    write_shim(host.plugins / PLUGIN_FOLDER, __version__)
    with host:
        host.discover()
        yield host


# Where the suite's caches and per-user folders go, relative to the session folder; the variables in UNSET would
# otherwise override them.
PRIVATE_DIRS = {
    "XDG_CACHE_HOME": "cache",  # pip's cache, the random demo model's fallback build, Hugging Face's default
    "XDG_CONFIG_HOME": "config",  # Chromium's profile and crash reports, pip's per-user configuration
    "XDG_DATA_HOME": "data",
    "XDG_STATE_HOME": "state",
    "KOBOLD_BACKEND_CACHE": "cache/kobold_backend/ext",  # the JIT build cache
    "HF_HOME": "cache/huggingface",
    "PIP_CACHE_DIR": "cache/pip",
}
UNSET = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_DATASETS_CACHE", "KOBOLD_BACKEND_WHEELS")
_saved_env: Dict[str, Optional[str]] = {}
_session_home: Optional[Path] = None


def pytest_configure(config: pytest.Config) -> None:
    """Point every cache into a fresh folder under $TMPDIR for this session (child processes inherit it)."""
    global _session_home
    _session_home = Path(tempfile.mkdtemp(prefix="kobold-backend-session-"))
    for name in list(PRIVATE_DIRS) + list(UNSET):
        _saved_env[name] = os.environ.pop(name, None)
    for name, sub in PRIVATE_DIRS.items():
        (_session_home / sub).mkdir(parents=True, exist_ok=True)
        os.environ[name] = str(_session_home / sub)


def pytest_unconfigure(config: pytest.Config) -> None:
    for name, value in _saved_env.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value
    if _session_home is not None:
        shutil.rmtree(_session_home, ignore_errors=True)
