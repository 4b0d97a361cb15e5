"""`kobold-backend bench --compare llamacpp` on the CPU, with a fake `llama-bench`: a script written here that checks
its arguments the way llama-bench parses them and prints llama-bench-shaped JSON (`-o json`), so the flag mapping,
the parsing, the ratio keys and the error sentences are tested without llama.cpp. With LLAMA_BENCH set to a real
llama-bench binary, the last test shows that llama.cpp loads the bench's synthetic GGUF files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from kobold_backend.bench.checkpoint import Shape
from kobold_backend.bench.gguf_checkpoint import RECIPES, recipe_types, use_more_bits, write_synthetic_gguf
from kobold_backend.bench.llamacpp import (
    LlamaBenchError,
    bench_args,
    gguf_file_type,
    run_llama_bench,
    variant_label,
)
from kobold_backend.cli.main import main
from kobold_backend.errors import ModelFormatError
from tests.test_cli_flags import loads  # noqa: F401  (the fixture: records model loads instead of running them)
from tests.test_server_cli import REPO

TINY = Shape(256, 512, 2, 4, 2, 300)

# The fake: llama-bench's list flags (-p, -n, -d comma-separated), one record per (depth, test) as llama-bench
# runs them, avg_ts a function of the test so the test below can predict it; FAKE_MODE=fail / badjson / noavg
# misbehave as a broken binary would. Every argv is appended to FAKE_LOG.
FAKE = r'''
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(argv) + "\n")
mode = os.environ.get("FAKE_MODE", "ok")
if mode == "fail":
    sys.stderr.write("llama_model_load: error loading model\nmain: error: failed to load model\n")
    sys.exit(3)
if mode == "badjson":
    print("| model | size | test | t/s |")
    sys.exit(0)
opts = dict(zip(argv[::2], argv[1::2]))
assert len(argv) % 2 == 0 and opts["-o"] == "json" and opts["-ngl"] == "99" and opts["-fa"] == "on", argv
assert os.path.isfile(opts["-m"]), argv
ints = lambda key, default: [int(v) for v in opts.get(key, default).split(",")]
records = []
for depth in ints("-d", "0"):
    for p in ints("-p", "512"):
        if p:
            records.append({"n_prompt": p, "n_gen": 0, "n_depth": depth, "avg_ts": 1000.0 + p, "stddev_ts": 1.5})
    for n in ints("-n", "128"):
        if n:
            records.append({"n_prompt": 0, "n_gen": n, "n_depth": depth, "avg_ts": 5000.0 / (10 + depth),
                            "stddev_ts": 0.5})
for r in records:
    r.update(build_commit="0c1e570", build_number=1, type_k=opts["-ctk"], type_v=opts["-ctv"],
             model_type="llama ?B Q4_K - Medium", gpu_info="", backends="CPU")
    if mode == "noavg":
        del r["avg_ts"]
print(json.dumps(records, indent=2))
'''


@pytest.fixture()
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An executable fake llama-bench; its calls land in FAKE_LOG."""
    script = tmp_path / "llama-bench"
    script.write_text(f"#!{sys.executable}\n{FAKE}")
    script.chmod(0o755)
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.delenv("FAKE_MODE", raising=False)
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    return script


def calls(tmp_path: Path) -> List[List[str]]:
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def test_bench_args_map_the_cache_dtype_and_the_tests() -> None:
    prompt = bench_args("m.gguf", "fp16", prompts=(512, 2048))
    assert prompt == ["-m", "m.gguf", "-ngl", "99", "-fa", "on", "-ctk", "f16", "-ctv", "f16", "-r", "3",
                      "-o", "json", "-p", "512,2048", "-n", "0"]
    decode = bench_args("m.gguf", "q8", depths=(4000, 16000), decode_steps=128)
    assert decode[6:10] == ["-ctk", "q8_0", "-ctv", "q8_0"]
    assert decode[-6:] == ["-p", "0", "-n", "128", "-d", "4000,16000"]
    assert bench_args("m", "q4", depths=(8,))[6:10] == ["-ctk", "q4_0", "-ctv", "q4_0"]
    assert bench_args("m", "k8v4", depths=(8,))[6:10] == ["-ctk", "q8_0", "-ctv", "q4_0"]
    with pytest.raises(ValueError):
        bench_args("m", "fp16")


def test_compare_llamacpp_times_the_same_file_and_writes_ratios(tmp_path: Path, fake: Path) -> None:
    path = write_synthetic_gguf(tmp_path / "m.gguf", TINY)
    (tmp_path / "llama-bench.build.json").write_text(json.dumps({"commit": "0c1e57098bba", "cmake_flags": ["-X"]}))
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(path), "--device", "cpu", "--quick", "--compare", "llamacpp",
            "--llamacpp-bench", str(fake), "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    ours, theirs = result["kobold_backend"], result["llamacpp"]
    assert theirs["prompt_tokens_per_s"] == {"16": 1016.0, "64": 1064.0}  # --quick's prompt lengths
    assert theirs["decode_tokens_per_s"] == {"16": 5000 / 26, "100": 5000 / 110}  # and its contexts as depths
    assert theirs["build_commit"] == "0c1e570" and theirs["cache_types"] == ["f16", "f16"]
    assert theirs["build"] == {"commit": "0c1e57098bba", "cmake_flags": ["-X"]}
    ratios = result["ratios"]["llamacpp"]["q4_k_m"]
    for figure in ("prompt_tokens_per_s", "decode_tokens_per_s"):
        assert set(ratios[figure]) == set(ours[figure])
        for n, r in ratios[figure].items():
            assert r == pytest.approx(ours[figure][n] / theirs[figure][n])
    assert "exllamav2" not in result and "transformers" not in result  # only the engines named
    prompt_call, decode_call = calls(tmp_path)
    assert prompt_call[prompt_call.index("-m") + 1] == str(path)
    assert prompt_call[-4:] == ["-p", "16,64", "-n", "0"]
    assert decode_call[-6:] == ["-p", "0", "-n", "8", "-d", "16,100"]


def test_a_quantized_cache_is_compared_under_its_own_key(tmp_path: Path, fake: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_synthetic_gguf(tmp_path / "m.gguf", TINY, recipe="Q8_0")
    out = tmp_path / "bench.json"
    monkeypatch.setenv("LLAMA_BENCH", str(fake))  # the binary from the environment
    argv = ["bench", "--model", str(path), "--device", "cpu", "--quick", "--contexts", "40", "--cache-dtype", "q8",
            "--compare", "llamacpp", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result["ratios"]["llamacpp"]) == {"q8"}
    assert set(result["ratios"]["llamacpp"]["q8"]["decode_tokens_per_s"]) == {"40"}
    assert all(call[6:10] == ["-ctk", "q8_0", "-ctv", "q8_0"] for call in calls(tmp_path))


def test_a_failing_llama_bench_is_recorded_and_our_figures_kept(tmp_path: Path, fake: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_synthetic_gguf(tmp_path / "m.gguf", TINY)
    out = tmp_path / "bench.json"
    monkeypatch.setenv("FAKE_MODE", "fail")
    assert main(["bench", "--model", str(path), "--device", "cpu", "--quick", "--compare", "llamacpp",
                 "--llamacpp-bench", str(fake), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["llamacpp"] == {"skipped": "llama-bench exited with status 3 (main: error: failed to load model)."}
    assert result["ratios"] == {} and result["kobold_backend"]["decode_tokens_per_s"]


@pytest.mark.parametrize("mode, words", [
    ("fail", "exited with status 3 (main: error: failed to load model)"),
    ("badjson", "printed no JSON on stdout"),
    ("noavg", "not a list of test records with avg_ts"),
])
def test_llama_bench_failures_are_one_sentence(tmp_path: Path, fake: Path, monkeypatch: pytest.MonkeyPatch,
                                               mode: str, words: str) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("FAKE_MODE", mode)
    with pytest.raises(LlamaBenchError) as exc:
        run_llama_bench(str(fake), bench_args(str(model), "fp16", depths=(8,)))
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_a_missing_binary_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(LlamaBenchError, match=r"^llama-bench .*nowhere does not exist\.$"):
        run_llama_bench(str(tmp_path / "nowhere"), ["-o", "json"])
    text = tmp_path / "llama-bench"
    text.write_text("not a program")
    with pytest.raises(LlamaBenchError, match="is not executable"):
        run_llama_bench(str(text), ["-o", "json"])


def test_compare_flag_errors_come_before_any_load(tmp_path: Path, fake: Path, loads: List[Any],  # noqa: F811
                                                  capsys: pytest.CaptureFixture,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    for argv, words in ((["bench", "--compare", "llama.cpp"], "use one or more of exllamav2, transformers, llamacpp"),
                        (["bench", "--compare", "llamacpp", "--llamacpp-bench", str(tmp_path / "no")],
                         "does not exist")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and words in err, err
    gguf_file = write_synthetic_gguf(tmp_path / "m.gguf", TINY)
    refused = [
        (["--compare", "llamacpp", "--model", str(gguf_file)], "needs llama.cpp's llama-bench binary"),
        (["--compare", "llamacpp", "--llamacpp-bench", str(fake)], "pass --model FILE.gguf or --format gguf"),
        (["--compare", "exllamav2,llamacpp", "--llamacpp-bench", str(fake), "--model", str(tmp_path)],
         "is not one"),
    ]
    for extra, words in refused:
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="kobold_backend"):
            assert main(["bench", "--device", "cpu", *extra]) == 1
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and words in errors[0], errors
    assert loads == []


def test_bare_compare_keeps_its_old_meaning() -> None:
    from kobold_backend.bench import add_bench_parser
    from kobold_backend.flag_types import ArgumentParser

    parser = ArgumentParser(prog="t")
    add_bench_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["bench", "--compare", "--quick"]).compare == ["exllamav2", "transformers"]
    assert parser.parse_args(["bench", "--compare", "llamacpp,exllamav2"]).compare == ["llamacpp", "exllamav2"]
    assert parser.parse_args(["bench"]).compare is None


# Each recipe's tensor types as llama.cpp's llama_tensor_get_type gives them for a llama model:
# (matrices, V/down of the use_more_bits layers, output head, token embedding).
LLAMA_CPP_TYPES: Dict[str, tuple] = {
    "Q4_K_M": ("Q4_K", "Q6_K", "Q6_K", "Q4_K"),
    "Q5_K_M": ("Q5_K", "Q6_K", "Q6_K", "Q5_K"),
    "Q4_0": ("Q4_0", "Q4_0", "Q6_K", "Q4_0"),
    "Q8_0": ("Q8_0", "Q8_0", "Q8_0", "Q8_0"),
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_each_recipe_writes_a_no_vocab_file_the_engine_loads(tmp_path: Path, recipe: str) -> None:
    import torch
    from gguf import GGUFReader

    from kobold_backend.engine.loader import load_model

    shape = Shape(256, 512, 8, 4, 2, 300)
    path = write_synthetic_gguf(tmp_path / "m.gguf", shape, recipe=recipe)
    reader = GGUFReader(str(path))
    stored = {t.name: t.tensor_type.name for t in reader.tensors}
    base, more, head, embed = LLAMA_CPP_TYPES[recipe]
    assert stored["output.weight"] == head and stored["token_embd.weight"] == embed
    for i in range(8):
        assert stored[f"blk.{i}.ffn_down.weight"] == (more if use_more_bits(i, 8) else base)
        assert stored[f"blk.{i}.attn_q.weight"] == base and stored[f"blk.{i}.attn_norm.weight"] == "F32"
    assert {name for name, _, _ in recipe_types(shape, recipe)} == set(stored)
    field = reader.fields["tokenizer.ggml.model"]
    assert bytes(field.parts[field.data[0]]).decode() == "no_vocab"
    assert gguf_file_type(str(path)) == recipe.lower()
    lm = load_model(path, device="cpu", with_tokenizer=False, max_seq_len=32)
    logits = lm.model.forward(torch.tensor([[1, 5, 9]]), lm.model.new_cache())
    assert torch.isfinite(logits).all() and logits.shape[-1] == 300
    with pytest.raises(ModelFormatError, match="no vocabulary .* but not serve text"):
        load_model(path, device="cpu", max_seq_len=32)


def test_variant_label_names_the_file_or_the_cache() -> None:
    assert variant_label("q4_k_m", "fp16") == "q4_k_m"
    assert variant_label("q4_k_m", "q8") == "q8"
    assert variant_label(None, "fp16") == "gguf"


@pytest.mark.skipif(not os.environ.get("LLAMA_BENCH"), reason="LLAMA_BENCH (a real llama-bench binary) is not set")
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_real_llama_bench_loads_the_synthetic_file(tmp_path: Path, recipe: str) -> None:
    """llama.cpp itself reads the bench's files: a short prompt and a few decode tokens after a filled q8_0 cache,
    with the arguments bench_args gives (on a CPU build -ngl is ignored)."""
    path = write_synthetic_gguf(tmp_path / "m.gguf", TINY, recipe=recipe)
    records = run_llama_bench(os.environ["LLAMA_BENCH"], bench_args(str(path), "q8", depths=(32,), decode_steps=8,
                                                                    repetitions=1) + ["-t", "2"])
    assert [(r["n_gen"], r["n_depth"], r["type_k"], r["type_v"]) for r in records] == [(8, 32, "q8_0", "q8_0")]
    assert records[0]["avg_ts"] > 0


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("cc") is None, reason="needs cmake and a C compiler")
def test_device_script_builds_in_the_background_and_records_the_build(tmp_path: Path) -> None:
    """tools/device_llamacpp.sh `build` then `wait` on a stand-in source tarball (a C project with a llama-bench
    target): the binary, and beside it the commit and the CMake flags; a second `build` does nothing; a broken
    tree ends `wait` with the build log's tail."""
    def tarball(name: str, cmakelists: str) -> Path:
        src = tmp_path / name / "llama.cpp"
        src.mkdir(parents=True)
        (src / "CMakeLists.txt").write_text(cmakelists)
        (src / "m.c").write_text("int main(void) { return 0; }\n")
        (src / "LLAMACPP_COMMIT").write_text("0c1e57098bba43ac29e6e3b677cdceebdd22334f\n")
        out = tmp_path / f"{name}.tar.gz"
        subprocess.run(["tar", "czf", str(out), "-C", str(src.parent), "llama.cpp"], check=True)
        return out

    def script(command: str, source: Path, where: Path) -> subprocess.CompletedProcess:
        env = dict(os.environ, LLAMACPP_DIR=str(where), LLAMACPP_TARBALL=os.path.relpath(source, REPO),
                   OUT=str(tmp_path / "out"), WAIT="120")
        return subprocess.run(["bash", "tools/device_llamacpp.sh", command], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=180)

    good = tarball("good", "cmake_minimum_required(VERSION 3.14)\nproject(x C)\n"
                           "set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n"
                           "add_executable(llama-bench m.c)\n")
    where = tmp_path / "lc"
    assert "build started" in script("build", good, where).stdout
    done = script("wait", good, where)
    assert done.returncode == 0 and "llama-bench ready" in done.stdout, done.stdout + done.stderr
    info = json.loads((where / "build/bin/llama-bench.build.json").read_text())
    assert info["commit"] == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    assert "-DGGML_CUDA=ON" in info["cmake_flags"] and "-DCMAKE_CUDA_ARCHITECTURES=90" in info["cmake_flags"]
    assert "already built" in script("build", good, where).stdout
    bad = tarball("bad", "message(FATAL_ERROR broken-on-purpose)\n")
    script("build", bad, tmp_path / "lc-bad")
    failed = script("wait", bad, tmp_path / "lc-bad")
    assert failed.returncode == 1 and "build failed (rc 1)" in failed.stdout and "broken-on-purpose" in failed.stdout
