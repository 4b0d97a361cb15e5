"""Every `kobold-backend` flag is checked before a model loads: a bad value is one line on stderr naming the flag
(exit 2), a port in use is one sentence (exit 1), never a traceback, and the loader is never called. Every
subcommand has a description and every option a help text that states its default."""

from __future__ import annotations

import argparse
import importlib
import logging
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, List

import pytest

from kobold_backend.cli import main as cli
from kobold_backend.progress import stderr_progress
from kobold_backend.server.engine_holder import EngineHolder
from tests.test_server_cli import REPO


@pytest.fixture()
def loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[List[Any]]:
    """Every call of the model loader or of the demo-model builder, recorded instead of run."""
    import kobold_backend.demo
    import kobold_backend.engine.loader

    calls: List[Any] = []

    def record(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise AssertionError("a model load started")

    # Modules that bound `load_model` at import hold their own reference: import them first and patch every
    # reference (patching only the loader's would leak the fake into a module first imported during the test).
    for name in ("engine_bench", "perplexity", "speculative_bench", "split"):
        importlib.import_module(f"kobold_backend.bench.{name}")
    real = kobold_backend.engine.loader.load_model
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("kobold_backend") and getattr(module, "load_model", None) is real:
            monkeypatch.setattr(module, "load_model", record)
    monkeypatch.setattr(kobold_backend.demo, "ensure_demo_model", record)
    yield calls


@pytest.fixture()
def held_port() -> Iterator[int]:
    """A port on 127.0.0.1 held by a listening socket for the test's duration."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


def bad_flag_cases(tmp: Path) -> List[Any]:
    a_file = tmp / "a_file.txt"
    a_file.write_text("x")
    absent = str(tmp / "absent")
    return [
        (["serve", "--port", "0"], "--port", "between 1 and 65535"),
        (["serve", "--port", "65536"], "--port", "between 1 and 65535"),
        (["serve", "--port", "http"], "--port", "not a whole number"),
        (["serve", "--max-length", "0"], "--max-length", "at least 1"),
        (["serve", "--queue", "-1"], "--queue", "at least 0"),
        (["serve", "--max-context", "0"], "--max-context", "at least 2"),
        (["serve", "--model", absent], "--model", "does not exist"),
        (["serve", "--models-dir", absent], "--models-dir", "does not exist"),
        (["serve", "--models-dir", str(a_file)], "--models-dir", "is not a folder"),
        (["serve", "--chat-template", absent], "--chat-template", "does not exist"),
        (["serve", "--chat-template", str(tmp)], "--chat-template", "is not a file"),
        (["serve", "--vectors-dir", absent], "--vectors-dir", "does not exist"),
        (["serve", "--lora-dir", str(a_file)], "--lora-dir", "is not a folder"),
        (["serve", "--capture-dir", absent], "--capture-dir", "does not exist"),
        (["serve", "--device", "gpu"], "--device", "auto, cpu, cuda, cuda:N"),
        (["serve", "--device", "cuda:99"], "--device", "cuda:99 was asked for"),
        (["serve", "--dtype", "int8"], "--dtype", "not one of float16, bfloat16, float32"),
        (["serve", "--rope-alpha", "0"], "--rope-alpha", "greater than 0"),
        (["serve", "--compress-pos-emb", "nan"], "--compress-pos-emb", "greater than 0"),
        (["serve", "--gpu-split", "20,lots"], "--gpu-split", "'lots' is not a number of GB"),
        (["serve", "--cpu-layers", "some"], "--cpu-layers", "a number of layers or 'auto'"),
        (["generate", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens", "at least 1"),
        (["generate", "--prompt", "x", "--max-context", "-5"], "--max-context", "at least 2"),
        (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature", "at least 0"),
        (["generate", "--prompt", "x", "--top-p", "1.5"], "--top-p", "at most 1"),
        (["generate", "--prompt", "x", "--top-k", "-1"], "--top-k", "at least 0"),
        (["generate", "--prompt", "x", "--rep-pen", "0.5"], "--rep-pen", "at least 1"),
        (["generate", "--prompt", "x", "--seed", "-2"], "--seed", "between 0 and"),
        (["generate", "--max-new-tokens", "5"], "--prompt", "required"),
        (["bench", "--group-size", "0"], "--group-size", "at least 1"),
        (["generate", "--prompt", "x", "--dtype", "half"], "--dtype", "not one of float16, bfloat16, float32"),
        # this wave's flags: KV cache storage, speculative decoding, the bench's format, contexts and perplexity
        (["serve", "--cache-dtype", "q3"], "--cache-dtype", "invalid choice: 'q3'"),
        (["generate", "--prompt", "x", "--cache-dtype", "int4"], "--cache-dtype", "invalid choice: 'int4'"),
        (["serve", "--speculative", "yes"], "--speculative", "invalid choice: 'yes'"),
        (["serve", "--speculative", "draft"], "--speculative", "draft needs --draft-model"),
        (["generate", "--prompt", "x", "--speculative", "draft"], "--speculative", "draft needs --draft-model"),
        (["serve", "--draft-model", absent], "--draft-model", "does not exist"),
        (["generate", "--prompt", "x", "--speculative", "ngram", "--draft-model", str(tmp)], "--draft-model",
         "goes with --speculative draft, not ngram"),
        (["serve", "--draft-tokens", "0"], "--draft-tokens", "between 1 and 16"),
        (["generate", "--prompt", "x", "--draft-tokens", "17"], "--draft-tokens", "between 1 and 16"),
        (["generate", "--prompt", "x", "--draft-tokens", "3"], "--draft-tokens", "needs --speculative ngram"),
        (["bench", "--format", "ggml"], "--format", "invalid choice: 'ggml'"),
        (["bench", "--contexts", "1"], "--contexts", "at least 2 tokens"),
        (["bench", "--contexts", "4000,lots"], "--contexts", "use token counts"),
        (["bench", "--contexts", "99999999"], "--contexts", "at most 1048576 tokens"),
        (["bench", "--cache-dtype", "q8,q5"], "--cache-dtype", "use one or more of fp16, q8, q4, k8v4"),
        (["bench", "--perplexity", absent], "--perplexity", "does not exist"),
        (["bench", "--draft-tokens", "0"], "--draft-tokens", "between 1 and 16"),
        (["bench", "--draft-preset", "huge"], "--draft-preset", "invalid choice: 'huge'"),
    ]


@pytest.mark.parametrize("case", range(49))
def test_bad_flag_is_one_line_exit_2_before_any_load(case: int, tmp_path: Path, loads: List[Any],
                                                     capsys: pytest.CaptureFixture) -> None:
    cases = bad_flag_cases(tmp_path)
    argv, flag, words = cases[case]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"kobold-backend {argv[0]}: error: ")
    assert flag in err and words in err, err
    assert loads == []


def test_the_parametrization_covers_every_case(tmp_path: Path) -> None:
    assert len(bad_flag_cases(tmp_path)) == 49


def test_bad_chat_template_is_a_usage_error_before_any_load(tmp_path: Path, loads: List[Any],
                                                            capsys: pytest.CaptureFixture) -> None:
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--chat-template", str(template), "--port", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kobold-backend serve: error: argument --chat-template: ")
    assert loads == []


def test_port_in_use_is_detected_before_the_model_loads(held_port: int, loads: List[Any],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        assert cli.main(["serve", "--port", str(held_port), "--device", "cpu"]) == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert errors[0].getMessage() == (f"Port {held_port} on 127.0.0.1 is already in use (is another server "
                                      "running?); stop it or choose another --port.")
    assert loads == []


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kobold_backend.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_port_in_use_as_a_process(held_port: int) -> None:
    """The real command: one sentence on stderr, exit 1, nothing loaded (no "loading" or demo log line)."""
    proc = run_cli("serve", "--port", str(held_port), "--device", "cpu")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [f"ERROR kobold_backend.serve: Port {held_port} on 127.0.0.1 is already in "
                                        "use (is another server running?); stop it or choose another --port."]
    assert proc.stdout == ""


def test_bad_flag_as_a_process(tmp_path: Path) -> None:
    proc = run_cli("serve", "--models-dir", str(tmp_path / "absent"), "--port", "5001")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"kobold-backend serve: error: argument --models-dir: {tmp_path / 'absent'} "
                                        "does not exist (see kobold-backend serve --help)"]


def test_unknown_host_is_one_sentence(loads: List[Any], caplog: pytest.LogCaptureFixture) -> None:
    assert cli.main(["serve", "--host", "no-such-host.invalid", "--port", "5001", "--device", "cpu"]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("--host no-such-host.invalid is not an address of this machine")
    assert loads == []


def subcommands() -> List[Any]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices.items())


def test_every_subcommand_has_a_description_and_every_option_a_help_with_its_default() -> None:
    names = [name for name, _ in subcommands()]
    assert {"serve", "generate", "doctor", "bench", "install-plugin", "install-ext"} <= set(names)
    for name, parser in subcommands():
        assert parser.description, f"{name} has no description"
        formatter = parser.formatter_class(prog=parser.prog)
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{label} has no help text"
            shown = formatter._get_help_string(action) % {"default": action.default}
            meaningful = action.default is not None and action.default is not False and action.default != []
            if meaningful and action.option_strings:  # an empty repeatable option and an off switch need none
                assert "default" in shown, f"{label}: the help does not state its default {action.default!r}"
        assert "%(default)s" not in parser.format_help()


def test_dtype_aliases() -> None:
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--dtype", "BF16"])
    assert args.dtype == "bfloat16"


def test_help_runs_for_every_subcommand(capsys: pytest.CaptureFixture) -> None:
    for name, _ in subcommands():
        with pytest.raises(SystemExit) as exc:
            cli.main([name, "--help"])
        assert exc.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: kobold-backend {name}")


def test_load_log_line_shows_no_function_repr(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The serve log used to print `<function stderr_progress.<locals>.report ...>` among the load options."""

    class Loaded:
        name = "m"
        model = type("M", (), {"max_seq_len": 8, "config": None})()
        tokenizer = None

    holder = EngineHolder(loader=lambda path, **kw: Loaded(), load_kwargs={"device": "cpu", "max_seq_len": 8})
    with caplog.at_level(logging.INFO, logger="kobold_backend.server.engine_holder"), \
            pytest.MonkeyPatch.context() as mp:
        import kobold_backend.engine.generator as gen

        mp.setattr(gen, "Generator", lambda model, tokenizer: None)
        holder.load(tmp_path, progress=stderr_progress("loading"))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("loading "))
    assert line == f"loading {tmp_path.resolve()} (device=cpu, max_seq_len=8)"


@pytest.mark.parametrize("fmt", ["exl2", "gguf"])
def test_gptq_only_bench_flags_are_refused_for_other_formats(fmt: str, tmp_path: Path, loads: List[Any],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """--act-order / --group-size shape only the synthetic GPTQ checkpoint: with another --format they are refused in
    one sentence before anything is written (they used to be ignored)."""
    for extra in (["--act-order"], ["--group-size", "32"]):
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="kobold_backend"):
            assert cli.main(["bench", "--preset", "tiny", "--format", fmt, *extra]) == 1
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "--act-order and --group-size" in errors[0] and fmt in errors[0], errors
    assert loads == []


def test_the_bench_module_alone_reports_bad_input_in_one_line() -> None:
    """`python -m kobold_backend.bench` (the bench without the rest of the CLI) answers like `kobold-backend bench`:
    a bad flag value is one usage line under its own name (exit 2), a refused combination one log line (exit 1),
    never a traceback."""
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kobold_backend.bench", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=120)

    bad = run("--contexts", "0")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith("python -m kobold_backend.bench: error: argument --contexts: "), bad.stderr
    refused = run("--preset", "tiny", "--format", "exl2", "--act-order")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines()[-1].endswith("writes its own layout, so drop them"), refused.stderr
