"""A request's n completions are run by the engine (Generator.stream_choices), not by the hosts: each completion
equals the single request with seed + i, carries its own figures and forward hooks, and an abort skips the
completions not yet started. No server, host or CLI module splits a request into its choices itself."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from kobold_backend.engine.generator import GenerationRequest, Generator
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.sampling import SamplerSettings

PACKAGE = Path(__file__).resolve().parent.parent / "kobold_backend"
HOT = SamplerSettings(temperature=1.5, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def lm(checkpoints: Any) -> Any:
    return load_model(checkpoints.get("dense_fp32").path, device="cpu", max_seq_len=256)


def _prompt(lm: Any, n: int = 12) -> List[int]:
    return torch.randint(3, lm.config.vocab_size, (n,), generator=torch.Generator().manual_seed(5)).tolist()


def _collect(items: Any) -> Dict[int, Dict[str, Any]]:
    out: Dict[int, Dict[str, Any]] = {}
    for item in items:
        got = out.setdefault(item.index, {"ids": [], "text": "", "stats": None})
        assert got["stats"] is None, "no event may follow the one that ends its completion"
        got["text"] += item.event.text
        if item.event.token_id is not None:
            got["ids"].append(item.event.token_id)
        if item.stats is not None:
            assert item.event.finish_reason is not None
            got["stats"] = item.stats
    return out


def test_each_choice_equals_the_single_request_with_its_seed(lm: Any) -> None:
    gen = Generator(lm.model, lm.tokenizer)
    prompt = _prompt(lm)
    many = _collect(gen.stream_choices(GenerationRequest(prompt, 10, HOT, ban_eos=True, seed=1234, n=3)))
    assert sorted(many) == [0, 1, 2]
    for i in range(3):
        single = gen.generate(GenerationRequest(prompt, 10, HOT, ban_eos=True, seed=1234 + i))
        assert many[i]["ids"] == single.token_ids and many[i]["text"] == single.text
        stats = many[i]["stats"]
        assert stats.seed == 1234 + i and stats.completion_tokens == len(single.token_ids) == 10
        assert stats.prompt_tokens == len(prompt)
    assert len({tuple(many[i]["ids"]) for i in range(3)}) > 1


def test_each_choice_gets_its_own_hooks_and_an_abort_skips_the_rest(lm: Any) -> None:
    gen = Generator(lm.model, lm.tokenizer)
    abort = threading.Event()
    seen: List[int] = []

    def hooks(choice: GenerationRequest) -> None:
        assert choice.n == 1 and choice.passthrough is None
        seen.append(choice.seed)
        return None

    done = _collect(gen.stream_choices(GenerationRequest(_prompt(lm), 4, HOT, seed=7, n=3, abort=abort), hooks))
    assert seen == [7, 8, 9] and sorted(done) == [0, 1, 2]
    ran: List[int] = []
    for item in gen.stream_choices(GenerationRequest(_prompt(lm), 4, HOT, seed=7, n=3, abort=abort)):
        ran.append(item.index)
        if item.stats is not None:
            abort.set()  # the first completion ended: the other two never start
    assert set(ran) == {0}


def choice_splitters(root: Path) -> List[str]:
    """Where a module outside the engine calls `.choices()` on a request (splitting it into its completions)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "choices"
                    and not node.args and not node.keywords):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_host_or_server_code_splits_a_request_into_choices(tmp_path: Path) -> None:
    assert choice_splitters(PACKAGE) == []
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "request.py").write_text("def f(req):\n    return req.choices()\n")
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "job.py").write_text("def run(gen, req):\n    for c in req.choices():\n"
                                                "        gen.stream(c)\n")
    assert choice_splitters(tmp_path) == ["server/job.py:2"]
