"""Issue 35's model-file reproducers against a `kobold-backend serve` subprocess with --models-dir: a FIFO, device or
folder where a model file belongs, a shard index of the wrong type or reaching outside the model folder, config
values and a chat template that cannot work, an oversized safetensors header, and load parameters that are not
finite numbers. Each PUT /api/v1/model (or POST /ui/load) is answered 4xx with one sentence within 2 s and 256 MiB
of extra memory, while other routes answer within 1 s and the model already loaded keeps generating the same
tokens throughout (a refused model is never swapped in). The CLI refuses the same files with one line."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import requests

from tests.test_server_cli import REPO, free_port, start_serve, stop

GREEDY = {"prompt": "Hello there", "max_length": 4, "temperature": 1.0, "top_k": 1, "rep_pen": 1.0,
          "sampler_seed": 1}
ANSWER_S = 2.0
OTHER_ROUTE_S = 1.0
EXTRA_MB = 256
KEPT_MB = 48


def _copy(good: Path, folder: Path, config: Any = None, drop: Tuple[str, ...] = ()) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(good, folder)
    for name in drop:
        (folder / name).unlink()
    if config:
        data = json.loads((folder / "config.json").read_text())
        data.update(config)
        (folder / "config.json").write_text(json.dumps(data))
    return folder


def _special(kind: str, path: Path) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        os.symlink("/dev/zero", path)
    else:
        path.mkdir()


def _indexed(good: Path, folder: Path, weight_map: Any) -> Path:
    """The model with its weights renamed and an index whose weight_map is `weight_map`."""
    _copy(good, folder)
    (folder / "model.safetensors").rename(folder / "w.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _header(folder: Path, header: Dict[str, Any], declared: int = 0) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", declared or len(raw)) + raw)


def _rss_mb(pid: int) -> Tuple[float, float]:
    """(resident, peak resident since the last reset) of process `pid` in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


class Watch:
    """Polls other routes (the model name, a greedy generation) from a thread while a refused load is answered."""

    def __init__(self, url: str, expected: Any) -> None:
        self.url, self.expected = url, expected
        self.slowest, self.answers, self.wrong = 0.0, 0, []  # type: float, int, List[Any]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for method, route, body in (("get", "/api/v1/model", None), ("post", "/api/v1/generate", GREEDY),
                                        ("get", "/api/extra/version", None)):
                start = time.monotonic()
                resp = requests.request(method, self.url + route, json=body, timeout=30)
                self.slowest = max(self.slowest, time.monotonic() - start)
                self.answers += 1
                data = resp.json()
                if route == "/api/v1/model" and data.get("result") != "kobold_backend/good":
                    self.wrong.append(data)
                if route == "/api/v1/generate" and data != self.expected:
                    self.wrong.append(data)

    def __enter__(self) -> Watch:
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(checkpoints: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("model_files")
    models = root / "models"
    good = _copy(checkpoints.get("dense_fp32").path, models / "good")
    proc, url, _ = start_serve(["--model", str(good), "--models-dir", str(models), "--port", str(free_port()),
                                "--device", "cpu", "--max-context", "96"])
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # its log never fills the pipe and blocks it
    try:
        expected = requests.post(url + "/api/v1/generate", json=GREEDY, timeout=30).json()
        yield proc, url, models, good, expected
    finally:
        stop(proc)


def refused(served: Any, send: Callable[[str], requests.Response]) -> Tuple[int, str]:
    """Send the load with another client polling; the status and the one sentence it answered, all bounds checked."""
    proc, url, _, _, expected = served
    Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # the peak resident size starts again from now
    before, _ = _rss_mb(proc.pid)
    with Watch(url, expected) as watch:
        start = time.monotonic()
        resp = send(url)
        took = time.monotonic() - start
    _, peak = _rss_mb(proc.pid)
    assert took < ANSWER_S, f"answered in {took:.1f} s"
    assert peak - before < EXTRA_MB, f"the load took {peak - before:.0f} MiB more"
    assert watch.answers and watch.slowest < OTHER_ROUTE_S, f"another route took {watch.slowest:.1f} s"
    assert not watch.wrong, watch.wrong
    assert requests.get(url + "/api/v1/model", timeout=10).json()["result"] == "kobold_backend/good"
    assert requests.post(url + "/api/v1/generate", json=GREEDY, timeout=30).json() == expected
    detail = resp.json()["detail"]
    message = detail["msg"] if "msg" in detail else next(iter(detail.values()))[0]
    assert "\n" not in message and "Traceback" not in message, message
    return resp.status_code, message


def put_model(name: str) -> Callable[[str], requests.Response]:
    return lambda url: requests.put(url + "/api/v1/model", json={"model": name}, timeout=60)


SPECIAL_FILES = [
    ("fifo", "model.safetensors", "model.safetensors is a FIFO (named pipe), not a regular file"),
    ("device", "model.safetensors", "model.safetensors is a character device, not a regular file"),
    ("folder", "model.safetensors", "model.safetensors is a folder, not a regular file"),
    ("fifo", "config.json", "config.json is a FIFO"),
    ("fifo", "tokenizer.model", "tokenizer.model is a FIFO"),
    ("fifo", "tokenizer.json", "tokenizer.json is a FIFO"),
    ("fifo", "tokenizer_config.json", "tokenizer_config.json is a FIFO"),
    ("fifo", "special_tokens_map.json", "special_tokens_map.json is a FIFO"),
    ("fifo", "generation_config.json", "generation_config.json is a FIFO"),
    ("fifo", "quantize_config.json", "quantize_config.json is a FIFO"),
    ("fifo", "chat_template.jinja", "chat_template.jinja is a FIFO"),
    ("device", "model.safetensors.index.json", "model.safetensors.index.json is a character device"),
]


@pytest.mark.parametrize("kind,name,message", SPECIAL_FILES)
def test_a_special_file_in_a_model_folder_is_refused_by_name(served: Any, kind: str, name: str,
                                                             message: str) -> None:
    _, _, models, good, _ = served
    _special(kind, _copy(good, models / "special") / name)
    status, text = refused(served, put_model("special"))
    assert status == 422 and message in text and text.startswith("Loading special failed: "), text


def test_a_fifo_named_gguf_is_refused_by_name(served: Any) -> None:
    _, _, models, _, _ = served
    _special("fifo", models / "pipe.gguf")
    status, text = refused(served, put_model("pipe.gguf"))
    assert status == 422 and "pipe.gguf is a FIFO (named pipe), not a regular file" in text, text


OUTSIDE = " names shard {!r} outside the model folder; shards must be files inside it."


def outside(name: str) -> str:
    """The refusal for `name`, which quotes at most its first 120 characters (a temporary folder's path can be
    longer)."""
    return OUTSIDE.format(name[:120])


def test_shard_indexes_of_the_wrong_type_or_outside_the_folder_are_refused(served: Any, tmp_path: Path) -> None:
    """Each with one sentence, and the same sentence whether the file outside exists or not."""
    _, _, models, good, _ = served
    elsewhere = tmp_path / "dense" / "model.safetensors"
    elsewhere.parent.mkdir()
    shutil.copy(good / "model.safetensors", elsewhere)
    missing = str(tmp_path / "absent" / "model.safetensors")
    cases = [
        ({"a": 5}, ": weight_map maps 'a' to 5; a shard file name is expected."),
        ([1, 2], ": weight_map is list; an object mapping tensor names to shard file names is expected."),
        ({"a": str(elsewhere)}, outside(str(elsewhere))),
        ({"a": missing}, outside(missing)),
        ({"a": "../../dense/model.safetensors"}, outside("../../dense/model.safetensors")),
        ({"a": "../../absent/model.safetensors"}, outside("../../absent/model.safetensors")),
        ({"a": "link.safetensors"}, outside("link.safetensors")),
        ({"a": "dangling.safetensors"}, outside("dangling.safetensors")),
        ({"a": "w.safetensors", "b": "gone.safetensors"}, " names shard gone.safetensors which is not in indexed."),
    ]
    for weight_map, message in cases:
        folder = _indexed(good, models / "indexed", weight_map)
        os.symlink(elsewhere, folder / "link.safetensors")
        os.symlink(missing, folder / "dangling.safetensors")
        status, text = refused(served, put_model("indexed"))
        assert status == 422 and text == "Loading indexed failed: model.safetensors.index.json" + message, text


@pytest.mark.parametrize("config,message", [
    ({"max_position_embeddings": 1}, "max_position_embeddings 1 is outside 2.."),
    ({"rope_theta": 0}, "rope_theta is 0; a finite number above 0 is expected."),
    ({"rms_norm_eps": -1}, "rms_norm_eps is -1; a finite number above 0 is expected."),
    ({"rms_norm_eps": 0}, "rms_norm_eps is 0; a finite number above 0 is expected."),
])
def test_config_values_that_cannot_work_are_422_naming_the_key(served: Any, config: Any, message: str) -> None:
    _, _, models, good, _ = served
    _copy(good, models / "values", config)
    status, text = refused(served, put_model("values"))
    assert status == 422 and message in text, text


@pytest.mark.parametrize("key,value,message", [
    ("llama.rope.freq_base", 0.0, "metadata llama.rope.freq_base is float '0.0'; a finite number above 0"),
    ("llama.attention.layer_norm_rms_epsilon", -1.0, "metadata llama.attention.layer_norm_rms_epsilon is float "
     "'-1.0'; a finite number above 0"),
    ("llama.attention.layer_norm_rms_epsilon", 0.0, "metadata llama.attention.layer_norm_rms_epsilon is float "
     "'0.0'; a finite number above 0"),
    ("llama.context_length", 1, "metadata llama.context_length is int '1'; a whole number from 2 to"),
])
def test_the_same_values_are_refused_in_a_gguf_file(served: Any, key: str, value: Any, message: str) -> None:
    """config.json's and a GGUF file's values are held to one rule (config_types: positive floats, sizes)."""
    import gguf

    from tests.fixtures import fuzz_files as ff

    _, _, models, _, _ = served
    kind = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
    (models / "values.gguf").write_bytes(ff.gguf_seed("llama", {key: (value, kind)}))
    status, text = refused(served, put_model("values.gguf"))
    assert status == 422 and message in text, text


def test_a_chat_template_that_does_not_compile_is_refused_at_load(served: Any) -> None:
    _, _, models, good, _ = served
    (_copy(good, models / "template") / "chat_template.jinja").write_text("{% for %}")
    status, text = refused(served, put_model("template"))
    assert status == 422 and "the chat template does not compile (line 1:" in text, text


def test_a_model_without_a_tokenizer_never_replaces_the_served_one(served: Any) -> None:
    """The folder's weights are fine; only its tokenizer is missing: the switch is refused before the served model
    is released (it used to be unloaded, then loaded again)."""
    _, _, models, good, _ = served
    _copy(good, models / "broken", drop=("tokenizer.model",))
    status, text = refused(served, put_model("broken"))
    assert status == 422 and "has no tokenizer (expected tokenizer.json or tokenizer.model)" in text, text


def test_oversized_safetensors_headers_are_refused_cheaply(served: Any) -> None:
    """Refused before the header is parsed (its length), or right after (its tensor count), and what the refusals
    took is given back: the server keeps no more than KEPT_MB of it."""
    proc, _, models, good, _ = served
    folder = _copy(good, models / "header")
    kept = _rss_mb(proc.pid)[0]
    _header(folder, {"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}, declared=60 << 20)
    status, text = refused(served, put_model("header"))
    assert status == 422 and "header length 62914560 is larger than the file" in text, text
    pad = {"__metadata__": {"pad": "x" * (9 << 20)}}
    _header(folder, pad)
    status, text = refused(served, put_model("header"))
    assert status == 422 and "more than the 8 MiB a safetensors header may take here" in text, text
    many = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(70_000)}
    _header(folder, many)
    status, text = refused(served, put_model("header"))
    assert status == 422 and "model.safetensors lists 70000 tensors, more than the 65536" in text, text
    assert _rss_mb(proc.pid)[0] - kept < KEPT_MB


@pytest.mark.parametrize("field,value", [("max_ctx", "inf"), ("max_ctx", "nan"), ("ntk_alpha", "inf"),
                                         ("ntk_alpha", "nan"), ("compress_emb", "nan"), ("CPU_Layers", "inf"),
                                         ("max_ctx", 1)])
def test_load_parameters_that_are_not_finite_are_422_naming_the_field(served: Any, field: str, value: Any) -> None:
    def send(url: str) -> requests.Response:
        return requests.post(url + "/ui/load", json={"model": "good", "parameters": {field: value}},
                             timeout=60)

    status, text = refused(served, send)
    assert status == 422, text
    assert text.startswith(f"{field} must be") and ("finite number" in text or "whole number" in text
                                                     or "at least 2" in text), text


def test_the_cli_refuses_a_fifo_with_one_line(served: Any) -> None:
    _, _, models, good, _ = served
    _special("fifo", _copy(good, models / "cli") / "model.safetensors")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kobold_backend.cli", "generate", "--model", str(models / "cli"),
                           "--prompt", "hi", "--device", "cpu", "--max-new-tokens", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and lines and "model.safetensors is a FIFO (named pipe)" in lines[-1], done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - start < 30  # the interpreter and torch start first; the refusal itself is instant


LONG_PIECES, PIECE_CHARS = 700, 20_000


def _long_piece_gguf(hf: Path, out: Path) -> Path:
    """The fixture model as a GGUF file whose SPM vocabulary has 700 pieces of 20,000 characters (14 MB of text),
    written in place of its last ordinary pieces (the issue's file: 64 s to load over HTTP before)."""
    import gguf
    import sentencepiece

    from tests.fixtures import gguf_files

    def vocab(writer: gguf.GGUFWriter, folder: Path) -> None:
        sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        types = [gguf_files.sentencepiece_token_type(sp, i) for i in range(sp.get_piece_size())]
        pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        ordinary = [i for i, t in enumerate(types) if t == gguf.TokenType.NORMAL][-LONG_PIECES:]
        for n, i in enumerate(ordinary):
            pieces[i] = chr(0x4E00 + n) * PIECE_CHARS
        writer.add_tokenizer_model("llama")
        writer.add_token_list(pieces)
        writer.add_token_scores([sp.get_score(i) for i in range(len(pieces))])
        writer.add_token_types(types)
        writer.add_bos_token_id(sp.bos_id())
        writer.add_eos_token_id(sp.eos_id())

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_files, "_sentencepiece_vocab", vocab)
        gguf_files.write_gguf(hf, out, {"*": "F32"})
    return out / "model.gguf"


def test_a_gguf_with_long_pieces_loads_in_seconds_while_the_old_model_serves(served: Any, tmp_path: Path) -> None:
    """The vocabulary's merges cost what its pieces weigh (not their squared length), and the switch's checks run
    while the old model keeps generating: only the swap of the weights themselves answers 503 "is loading"; the
    new model then answers. The old one is loaded back afterwards."""
    proc, url, models, good, expected = served
    shutil.copy(_long_piece_gguf(good, tmp_path / "long"), models / "long.gguf")
    assert (models / "long.gguf").stat().st_size > 14_000_000
    answers: List[Tuple[int, float, float, str]] = []

    def generate() -> None:
        while not done.is_set():
            start = time.monotonic()
            resp = requests.post(url + "/api/v1/generate", json=GREEDY, timeout=60)
            answers.append((resp.status_code, start, time.monotonic(), resp.text))

    done = threading.Event()
    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    try:
        time.sleep(0.1)
        start = time.monotonic()
        resp = put_model("long.gguf")(url)
        took = time.monotonic() - start
    finally:
        done.set()
        thread.join(timeout=60)
    assert resp.status_code == 200, resp.text
    assert took < 10.0, f"the load took {took:.1f} s"
    assert all(end - begin < OTHER_ROUTE_S for _, begin, end, _ in answers), answers
    old = [a for a in answers if a[0] == 200 and json.loads(a[3]) == expected and a[1] > start]
    busy = [a for a in answers if a[0] != 200]
    assert old, "the old model did not answer while the new one was checked"
    assert all(a[0] == 503 and "The model long.gguf is loading" in a[3] for a in busy), busy
    if busy:
        assert busy[-1][2] - busy[0][1] < OTHER_ROUTE_S, "the swap itself kept generation out for long"
    assert requests.get(url + "/api/v1/model", timeout=10).json()["result"] == "kobold_backend/long.gguf"
    assert requests.post(url + "/api/v1/generate", json=GREEDY, timeout=30).status_code == 200
    assert put_model("good")(url).status_code == 200
    assert requests.post(url + "/api/v1/generate", json=GREEDY, timeout=30).json() == expected
