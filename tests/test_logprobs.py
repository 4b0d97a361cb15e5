"""Per-token logprobs, checked against an independent oracle: the test runs the model forward itself on the prompt
plus the generated ids and takes log_softmax of those logits. Through the engine (with samplers, logit bias, bans
and rewinds that must not change the figures), KoboldCpp's shape through the real `koboldapi` client
(/api/v1/generate `logprobs: true`, /api/extra/last_logprobs and its genkey rule), and OpenAI's shapes through the
real `openai` client (/v1/completions `logprobs: N`, /v1/chat/completions `logprobs` + `top_logprobs`, streamed and
not)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence

import pytest
import requests
import torch

from kobold_backend.engine.chat_template import ChatFormatter
from kobold_backend.engine.generator import GenerationRequest, Generator
from kobold_backend.engine.loader import LoadedModel, load_model
from kobold_backend.engine.logprobs import TokenLogprob
from kobold_backend.engine.sampling import SamplerSettings
from kobold_backend.errors import RequestError
from tests.server_helpers import live_server, make_app
from tests.test_openai_chat_template import LLAMA2, with_template

PROMPT = "The old lighthouse keeper climbed the stairs"
TOL = 2e-3  # the generator's prefill + one-token steps against one full forward pass, float32 on the CPU


@pytest.fixture(scope="module")
def model_dir(checkpoints: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_template(checkpoints.get("dense_fp32").path, tmp_path_factory.mktemp("logprobs") / "dense_chat",
                         LLAMA2)


@pytest.fixture(scope="module")
def lm(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, device="cpu", max_seq_len=128)


def oracle(lm: LoadedModel, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> torch.Tensor:
    """log p(. | prompt + new[:i]) for each generated position i: [len(new_ids), V], float64."""
    ids = list(prompt_ids) + list(new_ids)
    cache = lm.model.new_cache(max_seq_len=len(ids))
    with torch.no_grad():
        logits = lm.model.forward(torch.tensor([ids]), cache, last_only=False)[0]
    return torch.log_softmax(logits.double(), dim=-1)[len(prompt_ids) - 1: len(ids) - 1]


def check_token(expected: torch.Tensor, token_id: int, logprob: float, top: Sequence[Any]) -> None:
    """One token's figures against the oracle row: the chosen token's log p, and the alternatives are the most
    likely tokens in order with their log p (ids compared where the oracle's values are not within TOL of a tie)."""
    assert logprob == pytest.approx(float(expected[token_id]), abs=TOL)
    values, ids = torch.topk(expected, len(top))
    for k, (tid, value) in enumerate(top):
        assert value == pytest.approx(float(values[k]), abs=TOL)
        assert float(expected[tid]) == pytest.approx(value, abs=TOL)
        gaps = [abs(float(values[k]) - float(values[j])) for j in (k - 1, k + 1) if 0 <= j < len(values)]
        if all(g > TOL for g in gaps):
            assert tid == int(ids[k])


def check_items(lm: LoadedModel, prompt_ids: Sequence[int], items: Sequence[TokenLogprob], n: int) -> None:
    expected = oracle(lm, prompt_ids, [i.token_id for i in items])
    for row, item in zip(expected, items):
        assert len(item.top) == n
        check_token(row, item.token_id, item.logprob, item.top)


# -- the engine ---------------------------------------------------------------------------------------------------

def test_engine_reports_the_models_distribution_before_the_samplers(lm: LoadedModel) -> None:
    prompt = lm.tokenizer.encode(PROMPT, add_bos=True)
    settings = SamplerSettings(temperature=1.3, top_k=12, top_p=0.9, rep_pen=1.4, logit_bias={100: 5.0})
    out = Generator(lm.model, lm.tokenizer).generate(GenerationRequest(
        prompt, 12, settings, seed=5, ban_eos=True, logprobs=4))
    assert out.logprobs is not None and len(out.logprobs) == 12
    assert [i.token_id for i in out.logprobs] == out.token_ids
    check_items(lm, prompt, out.logprobs, 4)
    assert b"".join(lm.tokenizer.token_bytes(i.token_id) for i in out.logprobs).decode("utf-8", "replace") \
        == out.text


def test_no_logprobs_unless_asked(lm: LoadedModel) -> None:
    prompt = lm.tokenizer.encode(PROMPT, add_bos=True)
    out = Generator(lm.model, lm.tokenizer).generate(GenerationRequest(prompt, 3, SamplerSettings(temperature=0)))
    assert out.logprobs is None
    zero = Generator(lm.model, lm.tokenizer).generate(GenerationRequest(
        prompt, 3, SamplerSettings(temperature=0), logprobs=0))
    assert zero.logprobs is not None and [i.top for i in zero.logprobs] == [(), (), ()]
    check_items(lm, prompt, zero.logprobs, 0)


def test_end_of_text_is_not_reported(lm: LoadedModel) -> None:
    """A logit bias forces EOS first: the run stops with nothing generated, so no logprobs (the bias is a sampler
    setting and would not show in the figures anyway)."""
    prompt = lm.tokenizer.encode(PROMPT, add_bos=True)
    eos = lm.tokenizer.eos_ids[0]
    events = list(Generator(lm.model, lm.tokenizer).stream(GenerationRequest(
        prompt, 5, SamplerSettings(temperature=0, logit_bias={eos: 100.0}), logprobs=2)))
    assert events[-1].finish_reason == "stop" and events[-1].logprobs == []


def test_banned_phrase_rewinds_take_their_logprobs_back(lm: LoadedModel) -> None:
    prompt = lm.tokenizer.encode(PROMPT, add_bos=True)
    generator = Generator(lm.model, lm.tokenizer)
    free = generator.generate(GenerationRequest(prompt, 16, SamplerSettings(temperature=0), ban_eos=True))
    words = [w for w in free.text.split() if len(w) >= 3]
    assert words, free.text
    out = generator.generate(GenerationRequest(prompt, 16, SamplerSettings(temperature=0), ban_eos=True,
                                               banned_strings=(words[0],), logprobs=3))
    assert words[0].lower() not in out.text.lower() and out.logprobs is not None
    text = b"".join(lm.tokenizer.token_bytes(i.token_id) for i in out.logprobs).decode("utf-8", "replace")
    assert text == out.text  # only the tokens that make up the output
    check_items(lm, prompt, out.logprobs, 3)


def test_logprobs_with_beams_is_refused(lm: LoadedModel) -> None:
    prompt = lm.tokenizer.encode(PROMPT, add_bos=True)
    with pytest.raises(RequestError, match="beam search cannot be combined with logprobs"):
        list(Generator(lm.model, lm.tokenizer).stream(GenerationRequest(prompt, 3, num_beams=2, logprobs=1)))


# -- KoboldCpp's shape through koboldapi ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(model_dir: Path) -> Any:
    with live_server(make_app(model_dir)) as srv:
        yield srv


def check_kobold_shape(lm: LoadedModel, prompt_ids: List[int], lp: Dict[str, Any], text: str) -> None:
    assert list(lp) == ["content", "tokens", "token_ids", "token_logprobs", "top_logprobs", "text_offset"]
    ids = lp["token_ids"]
    expected = oracle(lm, prompt_ids, ids)
    assert "".join(lp["tokens"]) == text
    offsets = [len("".join(lp["tokens"][:i])) for i in range(len(ids))]
    assert lp["text_offset"] == offsets
    for i, item in enumerate(lp["content"]):
        assert item["token"] == lp["tokens"][i] and item["token_id"] == ids[i]
        assert item["logprob"] == lp["token_logprobs"][i]
        assert bytes(item["bytes"]) == lm.tokenizer.token_bytes(ids[i])
        assert len(item["top_logprobs"]) == 5
        check_token(expected[i], ids[i], item["logprob"], [(t["token_id"], t["logprob"]) for t in item["top_logprobs"]])
        assert lp["top_logprobs"][i] == {t["token"]: t["logprob"] for t in item["top_logprobs"]}


def test_koboldapi_generate_and_get_last_logprobs(server: Any, lm: LoadedModel) -> None:
    from koboldapi.core.api import KoboldAPI

    api = KoboldAPI(server.url)
    api.genkey = "KCPP1111"
    text = api.generate(PROMPT, max_length=10, temperature=1.1, top_k=30, rep_pen=1.2, sampler_seed=9,
                        use_default_badwordsids=True, logprobs=True)
    lp = api.get_last_logprobs()
    assert lp is not None and len(lp["token_ids"]) == 10
    check_kobold_shape(lm, lm.tokenizer.encode(PROMPT, add_bos=True), lp, text)

    other = KoboldAPI(server.url)
    other.genkey = "KCPP2222"
    assert other.get_last_logprobs() is None  # another client's generation
    body = {"prompt": PROMPT, "max_length": 10, "temperature": 1.1, "top_k": 30, "rep_pen": 1.2, "sampler_seed": 9,
            "use_default_badwordsids": True, "logprobs": True, "min_p": 0.05, "top_p": 1.0}
    result = requests.post(server.url + "/api/v1/generate", json=body, timeout=60).json()["results"][0]
    assert result["text"] == text and result["logprobs"]["token_ids"] == lp["token_ids"]  # the same seed
    # (the prompt's cache is reused this time, so the figures agree to float32 rounding, not bit for bit)
    assert result["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    again = requests.post(server.url + "/api/extra/last_logprobs", json={}, timeout=10).json()
    assert again == {"logprobs": result["logprobs"]}
    requests.post(server.url + "/api/v1/generate", json={"prompt": "x", "max_length": 2}, timeout=60)
    assert requests.post(server.url + "/api/extra/last_logprobs", timeout=10).json() == {"logprobs": None}


def test_streamed_generation_keeps_logprobs_for_last_logprobs(server: Any, lm: LoadedModel) -> None:
    body = {"prompt": PROMPT, "max_length": 6, "temperature": 0, "use_default_badwordsids": True, "logprobs": True,
            "genkey": "KCPP3333"}
    resp = requests.post(server.url + "/api/extra/generate/stream", json=body, timeout=60)
    assert resp.status_code == 200 and "logprobs" not in resp.text  # KoboldCpp's SSE events carry no logprobs
    lp = requests.post(server.url + "/api/extra/last_logprobs", json={"genkey": "KCPP3333"}, timeout=10).json()
    assert lp["logprobs"] is not None and len(lp["logprobs"]["tokens"]) == 6
    text = requests.post(server.url + "/api/v1/generate", json=dict(body, genkey=""), timeout=60).json()
    check_kobold_shape(lm, lm.tokenizer.encode(PROMPT, add_bos=True), lp["logprobs"], text["results"][0]["text"])


def test_logprobs_field_is_validated(server: Any) -> None:
    resp = requests.post(server.url + "/api/v1/generate", json={"prompt": "x", "logprobs": "maybe"}, timeout=10)
    assert resp.status_code == 422 and "logprobs" in resp.json()["detail"]
    resp = requests.post(server.url + "/api/v1/generate", json={"prompt": "x", "logprobs": True, "num_beams": 2},
                         timeout=10)
    assert resp.status_code == 422 and "num_beams" in resp.json()["detail"]


# -- OpenAI's shapes through the openai client -------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def last_ids(server: Any) -> List[int]:
    """The ids of the last run, from /api/extra/last_logprobs (OpenAI's shapes carry token texts, not ids)."""
    return requests.post(server.url + "/api/extra/last_logprobs", timeout=10).json()["logprobs"]["token_ids"]


def test_openai_completions_logprobs(server: Any, client: Any, lm: LoadedModel) -> None:
    args = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.8, "seed": 4, "logprobs": 3,
            "extra_body": {"ignore_eos": True}}
    out = client.completions.create(**args)
    ids = last_ids(server)
    lp = out.choices[0].logprobs
    expected = oracle(lm, lm.tokenizer.encode(PROMPT, add_bos=True), ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(8)]
    for i, tid in enumerate(ids):
        assert lp.tokens[i] == lm.tokenizer.token_bytes(tid).decode("utf-8", "replace")
        assert lp.token_logprobs[i] == pytest.approx(float(expected[i, tid]), abs=TOL)
        top = lp.top_logprobs[i]
        best = torch.topk(expected[i], 3)
        names = [lm.tokenizer.token_bytes(int(t)).decode("utf-8", "replace") for t in best.indices]
        assert set(top) == set(names) | {lp.tokens[i]}  # OpenAI: the N most likely and the chosen token
        for name, value in zip(names, best.values):
            assert top[name] == pytest.approx(float(value), abs=TOL)

    streamed = list(client.completions.create(stream=True, **args))
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs is not None]
    assert len(pieces) == 1 and pieces[0].tokens == lp.tokens  # all in the finish_reason chunk
    assert pieces[0].token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)  # (a reused cache: rounding)
    assert pieces[0].text_offset == lp.text_offset
    assert client.completions.create(**dict(args, logprobs=None)).choices[0].logprobs is None


def test_openai_chat_logprobs(server: Any, client: Any, lm: LoadedModel, model_dir: Path) -> None:
    messages = [{"role": "user", "content": "What do you see from the top?"}]
    args = {"model": "m", "messages": messages, "max_tokens": 7, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "extra_body": {"ignore_eos": True}}
    out = client.chat.completions.create(**args)
    ids = last_ids(server)
    formatter = ChatFormatter(lm.tokenizer.chat_template, lm.tokenizer, model_dir)
    expected = oracle(lm, formatter.encode(formatter.render(messages)), ids)
    content = out.choices[0].logprobs.content
    assert len(content) == 7 and "".join(c.token for c in content) == out.choices[0].message.content
    for i, (tid, item) in enumerate(zip(ids, content)):
        assert bytes(item.bytes) == lm.tokenizer.token_bytes(tid)
        assert len(item.top_logprobs) == 2
        names = {lm.tokenizer.token_bytes(int(t)).decode("utf-8", "replace"): int(t)
                 for t in torch.topk(expected[i], 2).indices}
        check_token(expected[i], tid, item.logprob, [(names.get(t.token, -1), t.logprob) for t in item.top_logprobs])
    streamed = list(client.chat.completions.create(stream=True, **args))
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs is not None]
    assert len(chunks) == 1 and [c.token for c in chunks[0].content] == [c.token for c in content]
    assert [c.logprob for c in chunks[0].content] == pytest.approx([c.logprob for c in content], abs=1e-4)
    plain = client.chat.completions.create(**dict(args, logprobs=False, top_logprobs=None))
    assert plain.choices[0].logprobs is None


# -- CUDA: the figures from CUDA-graph decode steps (-m gpu) -----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dense_fp16", "gptq_v1_asym_g32"])
def test_cuda_graph_decode_logprobs_match_a_forward_pass(name: str, checkpoints: Any) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    lm = load_model(checkpoints.get(name).path, device="cuda", dtype="float16", max_seq_len=128)
    generator = Generator(lm.model, lm.tokenizer)
    prompt = lm.tokenizer.encode(PROMPT, add_bos=True)
    out = generator.generate(GenerationRequest(prompt, 16, SamplerSettings(temperature=1.0, top_k=40), seed=2,
                                               ban_eos=True, logprobs=5))
    assert out.logprobs is not None and len(out.logprobs) == 16
    expected = oracle(lm, prompt, [i.token_id for i in out.logprobs])
    for row, item in zip(expected, out.logprobs):
        # fp16 decode kernels (GEMV, graph replay) against the prefill path: agreement to fp16 rounding
        assert item.logprob == pytest.approx(float(row[item.token_id]), abs=5e-2)
        assert [v for _, v in item.top] == pytest.approx(torch.topk(row, 5).values.tolist(), abs=5e-2)
