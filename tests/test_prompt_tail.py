"""Prompts longer than the context are tokenized from their end (engine.tokenizer.encode_tail): the kept ids equal
those of tokenizing the whole text (the libraries' own tokenizers are the oracle), and the work done is bounded by
the kept part, not by the text's length (issue 17, D4)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, List

import pytest

from kobold_backend.engine.request import fit_text as fit_prompt
from kobold_backend.engine.tokenizer import encode_tail, load_tokenizer, surely_longer_than
from tests.test_tokenizer import TEXTS, reference


@pytest.fixture(params=["spm", "bpe"])
def tok(request: pytest.FixtureRequest, spm_dir: Path, bpe_dir: Path) -> Any:
    folder = spm_dir if request.param == "spm" else bpe_dir
    return reference(request.param, folder), load_tokenizer(folder)


def random_text(rng: random.Random, n_words: int) -> str:
    """Words of the fixture texts joined by one of several separators, so cuts land anywhere: mid-word, in runs of
    spaces, inside multi-byte characters and emoji sequences."""
    words = " ".join(TEXTS).split(" ")
    seps = [" ", "  ", "\n", "\n\n", "\t", "", " — "]
    return "".join(rng.choice(words) + rng.choice(seps) for _ in range(n_words))


def test_tail_ids_equal_the_whole_texts_tail(tok: Any) -> None:
    oracle, ours = tok
    rng = random.Random(17)
    for trial in range(40):
        text = random_text(rng, rng.randint(1, 3000))
        full = oracle(text)
        for keep in (1, 2, 7, 31, 100, 400, len(full) - 1, len(full), len(full) + 5):
            if keep < 1:
                continue
            ids, whole = encode_tail(ours, text, keep)
            assert ids == full[max(0, len(full) - keep):], (trial, keep)
            assert whole == (len(full) <= keep)


class CountingTokenizer:
    """A tokenizer that counts the characters it was asked to encode."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.bos_id = inner.bos_id
        self.prefix_ids = inner.prefix_ids
        self.chars = 0

    def encode(self, text: str, add_bos: bool = False) -> List[int]:
        self.chars += len(text)
        return self.inner.encode(text, add_bos=add_bos)


def test_a_huge_prompt_costs_what_its_kept_part_costs(tok: Any) -> None:
    """A 2-million-character prompt in a 100-token budget: only a few thousand characters are tokenized (the old
    path tokenized the whole prompt twice)."""
    oracle, ours = tok
    text = random_text(random.Random(5), 400_000)
    counting = CountingTokenizer(ours)
    ids = fit_prompt(counting, "Memory line.\n", text, 100)
    assert counting.chars < 20_000
    assert len(ids) == 100
    mem = oracle("Memory line.\n")
    bos = [] if ours.bos_id is None else [ours.bos_id]
    assert ids == bos + mem + oracle(text)[-(100 - len(bos) - len(mem)):]


def test_fit_prompt_keeps_its_rules(tok: Any) -> None:
    """Against the definition: the joint text when it fits; else the memory whole and the prompt's tail; else the
    memory's tail alone."""
    oracle, ours = tok
    bos = [] if ours.bos_id is None else [ours.bos_id]
    rng = random.Random(3)
    for _ in range(30):
        memory = random_text(rng, rng.randint(0, 30)) if rng.random() < 0.7 else ""
        prompt = random_text(rng, rng.randint(1, 300))
        budget = rng.randint(len(bos) + 1, 400)
        keep = budget - len(bos)
        joint = oracle(memory + prompt)
        mem = oracle(memory) if memory else []
        body = oracle(prompt)
        if len(joint) <= keep:
            want = bos + joint
        elif len(mem) >= keep:
            want = bos + mem[len(mem) - keep:]
        else:
            room = keep - len(mem)
            want = bos + mem + body[len(body) - room:]
        assert fit_prompt(ours, memory, prompt, budget) == want


def test_surely_longer_than_is_a_true_lower_bound(tok: Any) -> None:
    """Chat prompts are refused before tokenizing when their length alone proves they cannot fit: whenever the
    bound says so, the real token count is larger."""
    oracle, ours = tok
    rng = random.Random(11)
    decided = 0
    for _ in range(60):
        text = random_text(rng, rng.randint(1, 2000))
        n = len(oracle(text))
        for limit in (1, 5, n // 8, n // 2, n - 1, n):
            if surely_longer_than(ours, text, limit):
                decided += 1
                assert n > limit
    assert decided > 0
    assert surely_longer_than(ours, "x" * 10_000_000, 4096)
