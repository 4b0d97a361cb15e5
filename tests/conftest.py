"""Shared fixtures: tokenizers and tiny checkpoints built once per test session under one temporary folder, and a
KoboldAI United checkout for the plugin tests."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

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
