"""docs/performance.md's format table from bench JSON (kobold_backend/bench/report.py): the rows, the ratios
(ours ÷ theirs), the gaps, the provenance lines and the merged file, on a small hand-written sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kobold_backend.bench.report import main

GGUF_RUN = {
    "environment": {"gpu": "NVIDIA H200", "torch": "2.11.0", "kobold_backend": "0.9"},
    "cache_dtype": "fp16",
    "kobold_backend": {"prompt_tokens_per_s": {"2048": 30000.0, "512": 25000.0},
                       "decode_tokens_per_s": {"4000": 150.0, "128": 200.0}},
    "llamacpp": {"build_commit": "0c1e570", "build": {"commit": "0c1e57098bba", "cmake_flags": ["-DGGML_CUDA=ON"]},
                 "prompt_tokens_per_s": {"512": 10000.0, "2048": 9600.0},
                 "decode_tokens_per_s": {"128": 300.0, "4000": 250.0}},
    "ratios": {"llamacpp": {"q4_k_m": {"decode_tokens_per_s": {"128": 200.0 / 300.0, "4000": 0.6}}}},
}
GPTQ_RUN = {
    "environment": {"gpu": "NVIDIA H200", "torch": "2.11.0", "kobold_backend": "0.9"},
    "cache_dtype": "q8", "label": "gptq-7b",
    "kobold_backend": {"decode_tokens_per_s": {"128": 260.0}},
    "exllamav2": {"version": "0.3.2", "decode_tokens_per_s": {"128": 200.0}},
    "ratios": {"exllamav2": {"decode_tokens_per_s": {"128": 1.3}}},
}


def test_table_rows_ratios_and_provenance(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "q4km-7b.json").write_text(json.dumps(GGUF_RUN))
    (tmp_path / "merged.json").write_text(json.dumps({"runs": [GPTQ_RUN]}))
    assert main([str(tmp_path / "q4km-7b.json"), str(tmp_path / "merged.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:8] == [
        "| run | KV cache | figure | this engine | llama.cpp | ÷ llama.cpp | exllamav2 | ÷ exllamav2 |",
        "|---|---|---|---|---|---|---|---|",
        "| q4km-7b | fp16 | prompt 512 | 25,000 | 10,000 | 2.50 | — | — |",
        "| q4km-7b | fp16 | prompt 2,048 | 30,000 | 9,600 | 3.12 | — | — |",
        "| q4km-7b | fp16 | decode ctx 128 | 200.0 | 300.0 | 0.67 | — | — |",
        "| q4km-7b | fp16 | decode ctx 4,000 | 150.0 | 250.0 | 0.60 | — | — |",
        "| gptq-7b | q8 | decode ctx 128 | 260.0 | — | — | 200.0 | 1.30 |",
        "",
    ]
    assert out[8:] == [
        "- GPU NVIDIA H200, torch 2.11.0, kobold_backend 0.9; llama.cpp 0c1e57098bba (-DGGML_CUDA=ON)",
        "- GPU NVIDIA H200, torch 2.11.0, kobold_backend 0.9; exllamav2 0.3.2",
    ]


def test_merge_writes_one_file_that_renders_the_same(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "a.json").write_text(json.dumps(GGUF_RUN))
    (tmp_path / "b.json").write_text(json.dumps(GPTQ_RUN))
    merged = tmp_path / "formats.json"
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--merge", str(merged)]) == 0
    first = capsys.readouterr().out
    data = json.loads(merged.read_text())
    assert [run["label"] for run in data["runs"]] == ["a", "gptq-7b"]
    assert data["ratios"]["llamacpp"]["q4_k_m"]["decode_tokens_per_s"]["4000"] == 0.6
    assert data["ratios"]["exllamav2"]["decode_tokens_per_s"]["128"] == 1.3
    for run in data["runs"]:  # every run's ratios also under the merged file's own `ratios`, by reference and variant
        for reference, tree in run.get("ratios", {}).items():
            for variant, figures in tree.items():
                assert data["ratios"][reference][variant] == figures
    assert main([str(merged)]) == 0
    assert capsys.readouterr().out == first


def test_bad_input_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "x.json").write_text(json.dumps({"llamacpp": {}}))
    for argv, words in (([str(tmp_path / "none.json")], "no such file"),
                        ([str(tmp_path / "x.json")], "without this engine's figures")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and words in err, err
