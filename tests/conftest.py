"""Session-wide fixtures: tokenizers and tiny checkpoints built once per test session under one temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.checkpoints import CheckpointFactory
from tests.fixtures.tokenizers import write_byte_bpe, write_sentencepiece


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
