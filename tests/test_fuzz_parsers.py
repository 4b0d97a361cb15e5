"""Every model-file parser fed structured mutations of valid tiny files (hypothesis): GGUF, safetensors, EXL2
tensor groups, config.json, tokenizer files and chat templates. A parser may accept a file or refuse it with the
engine's error type; any other exception, a parse over 2 s or memory growth past a bound fails (tests/fixtures/
fuzz_files.py holds the seeds, the mutations and the bounds).

CI runs a short derandomized search per parser; KOBOLD_BACKEND_FUZZ_SECONDS=N runs each parser for about N seconds
with fresh random examples and prints the executions (`pytest -s`); tools/fuzz_parsers.py runs the same targets
coverage-guided under atheris.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any, Callable, Dict, Tuple

import pytest
import torch

from tests.fixtures import fuzz_files as ff

hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")

INTS = st.one_of(st.sampled_from(ff.INTERESTING), st.integers(0, 2**64 - 1))
LEAF = st.one_of(st.none(), st.booleans(), st.sampled_from(ff.INTERESTING), st.integers(-(2**70), 2**70),
                 st.floats(), st.text(max_size=12),
                 st.sampled_from(["F16", "BF16", "F32", "I32", "I64", "U8", "BOOL", "F8_E4M3", "", "llama", "gptq"]))
JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                     max_size=4), max_leaves=8)
JSON_OPS = st.lists(st.one_of(st.tuples(st.just("set"), st.integers(0, 10**4), JSON),
                              st.tuples(st.just("drop"), st.integers(0, 10**4)),
                              st.tuples(st.just("add"), st.text(max_size=24), JSON)), min_size=1, max_size=4)


def byte_ops(size: int, hot: int) -> Any:
    """Edits of a file of `size` bytes, positions mostly in its first `hot` bytes (the header)."""
    pos, hot_pos = st.integers(0, max(size, 1)), st.integers(0, max(hot, 1))
    return st.lists(st.one_of(
        st.tuples(st.just("field"), st.integers(0, 10**6), INTS),
        st.tuples(st.just("field"), st.integers(0, 10**6), INTS),
        st.tuples(st.just("int"), hot_pos, st.sampled_from([1, 2, 4, 8]), INTS),
        st.tuples(st.just("flip"), st.one_of(hot_pos, pos), st.integers(0, 7)),
        st.tuples(st.just("cut"), st.one_of(hot_pos, pos)),
        st.tuples(st.just("insert"), hot_pos, st.binary(max_size=16)),
        st.tuples(st.just("repeat"), hot_pos, st.integers(1, 64), st.integers(1, 8)),
    ), min_size=1, max_size=4)


def fuzz(name: str, strategy: Any, target: Callable[[Any, Any], None], seed: Any, ci_examples: int) -> ff.Bounds:
    """Run `target` on the seed, then on `ci_examples` derandomized examples (CI) or on fresh random examples for
    KOBOLD_BACKEND_FUZZ_SECONDS; every run held to ff.Bounds."""
    bounds = ff.Bounds()
    bounds.run(target, seed)  # the seed is valid: it must load (and warms imports before the clock matters)
    assert bounds.refused == 0, f"the {name} seed itself was refused"
    seconds = ff.fuzz_seconds()

    @hypothesis.settings(max_examples=ci_examples if not seconds else 300, derandomize=not seconds, deadline=None,
                         database=None, suppress_health_check=list(hypothesis.HealthCheck), print_blob=True)
    @hypothesis.given(strategy)
    def one(data: Any) -> None:
        bounds.run(target, data)

    end = time.monotonic() + seconds
    one()
    while time.monotonic() < end:
        one()
    print(f"\nfuzz {name}: {bounds.executions} executions, {bounds.refused} refused, slowest "
          f"{bounds.slowest:.3f} s")
    return bounds


@functools.lru_cache(maxsize=None)
def gguf_seeds() -> Tuple[Tuple[bytes, Tuple[Tuple[int, int], ...]], ...]:
    return tuple((data, tuple(ff.gguf_fields(data))) for data in (ff.gguf_seed("llama"), ff.gguf_seed("gpt2")))


def test_gguf() -> None:
    def mutated(choice: int) -> Any:
        data, fields = gguf_seeds()[choice]
        header = max(pos for pos, _ in fields) + 16
        return st.builds(ff.mutate_bytes, st.just(data), byte_ops(len(data), header), st.just(fields))

    strategy = st.sampled_from([0, 1]).flatmap(mutated)
    fuzz("gguf", strategy, ff.read_gguf, gguf_seeds()[0][0], ci_examples=120)


def test_safetensors() -> None:
    seed = ff.safetensors_seed()
    header, body = ff.split_safetensors(seed)
    in_header = st.builds(lambda ops, declared: ff.join_safetensors(ff.mutate_json(header, ops), body, declared),
                          JSON_OPS, st.one_of(st.none(), INTS))
    raw = st.builds(ff.mutate_bytes, st.just(seed), byte_ops(len(seed), len(seed) - len(body)))
    fuzz("safetensors", st.one_of(in_header, raw), ff.read_safetensors, seed, ci_examples=150)


def _apply_tensor_ops(seed: Dict[str, torch.Tensor], ops: Any) -> Dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in seed.items()}
    for kind, name, a, b in ops:
        if name not in out:
            continue
        t = out[name]
        if kind == "value" and t.numel():
            flat = t.reshape(-1)
            info = torch.finfo(t.dtype) if t.dtype.is_floating_point else torch.iinfo(t.dtype)
            flat[a % t.numel()] = max(info.min, min(info.max, b))
        elif kind == "shape":
            shape = tuple(d % 300 for d in a[:3])
            out[name] = torch.randint(-(2**15), 2**15, shape, generator=torch.Generator().manual_seed(b % 1000)
                                      ).to(t.dtype)
        elif kind == "dtype":
            out[name] = t.to((torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.uint8)[a % 6])
        elif kind == "drop":
            del out[name]
    return out


def test_exl2() -> None:
    seed = ff.exl2_seed()
    names = st.sampled_from(sorted(seed) + ["bias"])
    values = st.one_of(st.integers(-40, 300), st.sampled_from([-(2**31), 2**31 - 1, -1, 2**15 - 1, -(2**15)]))
    op = st.one_of(st.tuples(st.just("value"), names, st.integers(0, 10**6), values),
                   st.tuples(st.just("value"), st.just("q_groups"), st.integers(0, 10**6), values),
                   st.tuples(st.just("value"), st.just("q_invperm"), st.integers(0, 10**6), values),
                   st.tuples(st.just("shape"), names, st.lists(st.integers(0, 10**6), min_size=1, max_size=3),
                             st.integers(0, 10**6)),
                   st.tuples(st.just("dtype"), names, st.integers(0, 5), st.just(0)),
                   st.tuples(st.just("drop"), names, st.just(0), st.just(0)))
    strategy = st.builds(functools.partial(_apply_tensor_ops, seed), st.lists(op, min_size=1, max_size=3))
    fuzz("exl2", strategy, ff.read_exl2, seed, ci_examples=120)


def test_config_json() -> None:
    seed = ff.config_seed()
    text = json.dumps(seed).encode("utf-8")
    structured = st.builds(lambda ops: {"config.json": json.dumps(ff.mutate_json(seed, ops)).encode("utf-8")},
                           JSON_OPS)
    with_side_files = st.builds(
        lambda ops, name, extra: {"config.json": json.dumps(ff.mutate_json(seed, ops)).encode("utf-8"),
                                  name: json.dumps(extra).encode("utf-8")},
        JSON_OPS, st.sampled_from(["generation_config.json", "quantize_config.json", "quant_config.json"]),
        st.one_of(JSON, st.builds(ff.mutate_json, st.just({"bits": 4, "group_size": 32, "bos_token_id": 1,
                                                           "eos_token_id": [2]}), JSON_OPS)))
    raw = st.builds(lambda ops: {"config.json": ff.mutate_bytes(text, ops)}, byte_ops(len(text), len(text)))
    fuzz("config.json", st.one_of(structured, with_side_files, raw), ff.read_config, {"config.json": text},
         ci_examples=200)


def test_shard_index() -> None:
    """weight_map of the wrong type, or naming shards outside the folder (issue 35): refused, never read."""
    seed = ff.shard_index_seed()
    shard = ff.safetensors_seed()

    def files(index: Any) -> Dict[str, Any]:
        return {"model.safetensors.index.json": json.dumps(index).encode("utf-8"), "model.safetensors": shard}

    names = st.one_of(st.sampled_from(ff.SHARD_NAMES), JSON)
    renamed = st.builds(lambda tensor, name: files(dict(seed, weight_map=dict(seed["weight_map"], **{tensor: name}))),
                        st.sampled_from(["a.weight", "b.bias", "c", "d"]), names)
    replaced = st.builds(lambda wm: files(dict(seed, weight_map=wm)), JSON)
    structured = st.builds(lambda ops: files(ff.mutate_json(seed, ops)), JSON_OPS)
    fuzz("shard index", st.one_of(renamed, replaced, structured), ff.read_shard_index, files(seed), ci_examples=120)


CONFIG_VALUES = ["rope_theta", "rms_norm_eps", "max_position_embeddings", "hidden_size", "num_hidden_layers",
                 "vocab_size", "head_dim"]


def test_config_values() -> None:
    """The values issue 35 found accepted (rope_theta 0, rms_norm_eps -1, a one-position context), and their
    neighbours: refused with the engine's error or accepted, within the bounds."""
    seed = ff.config_seed()
    value = st.sampled_from([0, -1, 1, 2, 0.0, -0.0, 1e-300, 1e308, float("nan"), float("inf"), "inf", "0", None,
                             True, [], {}])
    strategy = st.builds(lambda key, v: {"config.json": json.dumps(dict(seed, **{key: v})).encode("utf-8")},
                         st.sampled_from(CONFIG_VALUES), value)
    fuzz("config values", strategy, ff.read_config, {"config.json": json.dumps(seed).encode("utf-8")},
         ci_examples=60)


SPECIAL_FILES = [
    (ff.read_config, "config.json"), (ff.read_config, "generation_config.json"),
    (ff.read_config, "quantize_config.json"), (ff.read_tokenizer, "tokenizer.json"),
    (ff.read_tokenizer, "tokenizer.model"), (ff.read_tokenizer, "tokenizer_config.json"),
    (ff.read_tokenizer, "special_tokens_map.json"), (ff.read_tokenizer, "chat_template.jinja"),
    (ff.read_shard_index, "model.safetensors"), (ff.read_shard_index, "model.safetensors.index.json"),
]


@pytest.mark.parametrize("special", [ff.FIFO, ff.FOLDER])
def test_special_files_are_refused_before_they_are_opened(special: str) -> None:
    """A FIFO or a folder under any model file's name: refused with the engine's error (a FIFO used to block the
    open for good), each within the bounds."""
    config = json.dumps(ff.config_seed()).encode("utf-8")
    tokenizer = json.dumps(ff.tokenizer_json_seed()).encode("utf-8")
    index = json.dumps(ff.shard_index_seed()).encode("utf-8")
    bounds = ff.Bounds()
    for target, name in SPECIAL_FILES:
        files = {"config.json": config} if target is ff.read_config else \
            {"tokenizer.json": tokenizer} if target is ff.read_tokenizer else \
            {"model.safetensors.index.json": index, "model.safetensors": ff.safetensors_seed()}
        if name == "tokenizer.model":
            files = {}  # read only where there is no tokenizer.json
        bounds.run(target, dict(files, **{name: special}))
        assert bounds.refused == bounds.executions, f"{name} as {special} was not refused"


def test_tokenizer_files() -> None:
    tok, cfg, spm = ff.tokenizer_json_seed(), ff.tokenizer_config_seed(), ff.sentencepiece_seed()

    def dumps(doc: Any) -> bytes:
        return json.dumps(doc).encode("utf-8")

    cfg_files = st.one_of(st.just({}), st.builds(lambda ops: {"tokenizer_config.json": dumps(ff.mutate_json(cfg, ops))},
                                                 JSON_OPS),
                          st.builds(lambda v: {"special_tokens_map.json": dumps(v)}, JSON))
    tok_json = st.builds(lambda ops: {"tokenizer.json": dumps(ff.mutate_json(tok, ops))}, JSON_OPS)
    tok_model = st.builds(lambda ops: {"tokenizer.model": ff.mutate_bytes(spm, ops)}, byte_ops(len(spm), len(spm)))
    strategy = st.builds(lambda a, b: dict(a, **b), st.one_of(tok_json, tok_model), cfg_files)
    fuzz("tokenizer files", strategy, ff.read_tokenizer, {"tokenizer.json": dumps(tok)}, ci_examples=120)
    fuzz("tokenizer.model", tok_model, ff.read_tokenizer, {"tokenizer.model": spm}, ci_examples=60)


def test_chat_templates() -> None:
    pieces = st.lists(st.sampled_from(ff.TEMPLATE_PIECES + ff.TEMPLATE_SEEDS), min_size=1, max_size=6).map("".join)
    edited = st.builds(lambda seed, ops: ff.mutate_bytes(seed.encode(), ops).decode("utf-8", "replace"),
                       st.sampled_from(ff.TEMPLATE_SEEDS), byte_ops(200, 200))
    fuzz("chat templates", st.one_of(pieces, edited), ff.render_template, ff.TEMPLATE_SEEDS[0], ci_examples=200)
