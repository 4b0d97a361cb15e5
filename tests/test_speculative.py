"""Speculative decoding on tiny CPU models: greedy output identical to plain decoding (stops, bans, grammar,
logprobs; passthrough, CFG, beams and mirostat fall back), sampled output distributed as plain sampling
(chi-square against the exact distribution the plain sampler draws from), the n-gram drafter's proposals, the
draft-tokenizer check and the load options."""

from __future__ import annotations

import argparse
from collections import Counter
from itertools import product
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from kobold_backend.engine.drafters import NgramDrafter, check_draft_tokenizer
from kobold_backend.engine.generator import GenerationRequest, Generator
from kobold_backend.engine.load_options import load_options, requested_parameters
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.sampling import Sampler, SamplerSettings
from kobold_backend.engine.speculative import SpeculationConfig, choose
from kobold_backend.errors import ModelFormatError, RequestError

GREEDY = SamplerSettings(temperature=0)
P_THRESHOLD = 1e-3  # a correct sampler fails this one time in a thousand; each seed below is fixed


@pytest.fixture(scope="module")
def lm(checkpoints: Any) -> Any:
    return load_model(checkpoints.get("dense_fp32").path, device="cpu", max_seq_len=256)


@pytest.fixture(scope="module")
def draft_lm(checkpoints: Any) -> Any:
    """Same tokenizer, other weights: its drafts are mostly wrong, so rejection and resampling are exercised."""
    return load_model(checkpoints.get("dense_fp16").path, device="cpu", dtype="float32", max_seq_len=256)


@pytest.fixture(scope="module")
def near_lm(checkpoints: Any) -> Any:
    """The target with its final norm scaled by random factors: right often, wrong often."""
    near = load_model(checkpoints.get("dense_fp32").path, device="cpu", max_seq_len=256)
    near.model.norm.mul_(1 + 0.5 * torch.randn(near.model.norm.shape, generator=torch.Generator().manual_seed(0)))
    return near


def _speculating(lm: Any, config: SpeculationConfig) -> Generator:
    gen = Generator(lm.model, lm.tokenizer)
    gen.use_speculation(config)
    return gen


@pytest.fixture(scope="module")
def generators(lm: Any, draft_lm: Any, near_lm: Any) -> Dict[str, Generator]:
    return {
        "plain": Generator(lm.model, lm.tokenizer),
        "ngram": _speculating(lm, SpeculationConfig("ngram", 4)),
        "self": _speculating(lm, SpeculationConfig("draft", 4, lm.model, "self")),
        "other": _speculating(lm, SpeculationConfig("draft", 3, draft_lm.model)),
        "near": _speculating(lm, SpeculationConfig("draft", 3, near_lm.model)),
    }


MODES = ("ngram", "self", "other", "near")


def _prompt(lm: Any, seed: int, n: int = 16) -> List[int]:
    """A random prompt that repeats its first half, so prompt lookup finds matches."""
    ids = torch.randint(3, lm.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return ids + ids[: n // 2]


def _both(generators: Dict[str, Generator], mode: str, **kwargs: Any) -> Tuple[Any, Any]:
    plain = generators["plain"].generate(GenerationRequest(**kwargs))
    spec = generators[mode].generate(GenerationRequest(**kwargs))
    return plain, spec


@pytest.mark.parametrize("mode", MODES)
def test_greedy_matches_plain_decoding(lm: Any, generators: Dict[str, Generator], mode: str) -> None:
    drafted = 0
    for seed, length in product(range(4), (1, 6, 40)):
        plain, spec = _both(generators, mode, prompt_ids=_prompt(lm, seed), max_new_tokens=length,
                            settings=GREEDY, ban_eos=True)
        assert spec.token_ids == plain.token_ids, (seed, length)
        assert spec.text == plain.text and spec.finish_reason == plain.finish_reason
        stats = generators[mode].stats.speculation
        assert stats is not None and stats.fallback == ""
        drafted += stats.drafted
    assert drafted > 0, "the drafter must have proposed tokens for the comparison to test speculation"
    if mode == "self":
        assert generators[mode].stats.speculation.acceptance_rate == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_greedy_with_stops_bans_and_logprobs(lm: Any, generators: Dict[str, Generator], mode: str) -> None:
    prompt = _prompt(lm, 7)
    full = generators["plain"].generate(GenerationRequest(prompt, 40, GREEDY, ban_eos=True)).text
    assert len(full) > 12
    stop, banned = full[8:11], full[3:6]
    plain, spec = _both(generators, mode, prompt_ids=prompt, max_new_tokens=40, settings=GREEDY, ban_eos=True,
                        stop_strings=[stop])
    assert (spec.text, spec.finish_reason, spec.token_ids) == (plain.text, plain.finish_reason, plain.token_ids)
    assert spec.finish_reason == "stop_string"
    plain, spec = _both(generators, mode, prompt_ids=prompt, max_new_tokens=40, settings=GREEDY, ban_eos=True,
                        banned_strings=[banned])
    assert banned.lower() not in spec.text.lower()
    assert (spec.text, spec.token_ids) == (plain.text, plain.token_ids)
    plain, spec = _both(generators, mode, prompt_ids=prompt, max_new_tokens=20, settings=GREEDY, ban_eos=True,
                        logprobs=3)
    assert spec.token_ids == plain.token_ids
    for a, b in zip(plain.logprobs, spec.logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.parametrize("mode", ("ngram", "self", "other"))
def test_greedy_with_a_grammar(lm: Any, generators: Dict[str, Generator], mode: str) -> None:
    pytest.importorskip("llguidance")
    from kobold_backend.engine.grammar import GrammarConstraint

    grammars = ('root ::= "[" item ("," " "? item){0,5} "]"\nitem ::= [a-c] | "x" [0-9]',
                'root ::= [^.]{1,40} "."')  # a strict one and one that most drafts satisfy
    accepted = drafted = 0
    for gbnf, seed in product(grammars, range(3)):
        outs = []
        for name in ("plain", mode):
            grammar = GrammarConstraint.build(lm.tokenizer, gbnf=gbnf)
            outs.append(generators[name].generate(GenerationRequest(_prompt(lm, seed), 40, GREEDY, grammar=grammar)))
        assert outs[1].text == outs[0].text and outs[1].token_ids == outs[0].token_ids, (gbnf, seed)
        accepted += generators[mode].stats.speculation.accepted
        drafted += generators[mode].stats.speculation.drafted
    if mode == "self":  # the unconstrained draft is sometimes grammatical and sometimes not
        assert 0 < accepted < drafted


def test_unspeculable_features_fall_back_and_say_so(lm: Any, generators: Dict[str, Generator]) -> None:
    from kobold_backend.engine.passthrough import PassthroughConfig, build_passthrough

    prompt = _prompt(lm, 3)
    gen = generators["ngram"]
    vector = torch.randn(lm.config.hidden_size, generator=torch.Generator().manual_seed(5)).tolist()
    cases = {
        "passthrough": dict(passthrough=build_passthrough(
            {"steer": {"vector": vector, "strength": 2.0, "layers": [0]}}, lm.model, PassthroughConfig())),
        "negative prompt (CFG)": dict(negative_prompt_ids=_prompt(lm, 4), guidance_scale=1.5),
        "beam search": dict(num_beams=2),
        "mirostat": dict(settings=SamplerSettings(mirostat=2, temperature=0.8)),
    }
    for reason, extra in cases.items():
        kwargs: Dict[str, Any] = dict(prompt_ids=prompt, max_new_tokens=12, settings=GREEDY, seed=3)
        kwargs.update(extra)
        plain, spec = _both(generators, "ngram", **kwargs)
        assert spec.token_ids == plain.token_ids, reason
        assert gen.stats.speculation.fallback == reason and gen.stats.speculation.drafted == 0
    assert generators["plain"].stats.speculation is None


def test_prefix_reuse_follows_the_target(lm: Any, generators: Dict[str, Generator]) -> None:
    gen = generators["other"]
    prompt = _prompt(lm, 11)
    first = gen.generate(GenerationRequest(prompt, 10, GREEDY, ban_eos=True))
    follow = prompt + first.token_ids + _prompt(lm, 12, 6)
    again, plain = _both(generators, "other", prompt_ids=follow, max_new_tokens=10, settings=GREEDY, ban_eos=True)
    assert gen.stats.reused_tokens >= len(prompt)
    drafter = gen.speculator.drafter  # type: ignore[union-attr]
    assert drafter.lane.cache.tokens[: len(follow)] == follow  # the draft cache followed the new prompt
    assert again.token_ids == plain.token_ids


# ---------------------------------------------------------------- the rejection rule keeps the distribution


def _p_value(observed: Sequence[int], expected: Sequence[float]) -> float:
    """Pearson chi-square goodness of fit; cells expecting fewer than 5 draws are pooled into one."""
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for o, e in zip(observed, expected):
        if e < 5.0:
            pool_o, pool_e = pool_o + o, pool_e + e
        else:
            obs.append(float(o))
            exp.append(e)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def test_chi_square_helper_rejects_a_wrong_distribution() -> None:
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(torch.tensor([0.5, 0.3, 0.2]), 3000, replacement=True, generator=g)
    counts = torch.bincount(draws, minlength=3).tolist()
    assert _p_value(counts, [1500.0, 900.0, 600.0]) > P_THRESHOLD
    assert _p_value(counts, [1350.0, 1050.0, 600.0]) < P_THRESHOLD


@pytest.mark.parametrize("draft", ("model", "point"))
def test_rejection_rule_draws_the_processed_target_distribution(draft: str) -> None:
    """Six-token vocabulary: temperature, top-k and a logit bias on the target side, an unrelated q (or a point
    mass) proposing; the chosen tokens must follow the hand-computed processed p."""
    vocab, n = 6, 6000
    logits = torch.tensor([2.0, 1.5, 0.3, 0.0, -1.0, 1.0])
    settings = SamplerSettings(temperature=0.7, top_k=4, logit_bias={2: 1.0})
    kept = logits + torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    top = torch.topk(kept, 4).indices
    masked = torch.full((vocab,), float("-inf"))
    masked[top] = kept[top] / 0.7
    p = torch.softmax(masked, dim=-1)
    q = torch.softmax(torch.tensor([0.0, 2.0, -1.0, 1.5, 0.5, 0.0]), dim=-1)
    sampler = Sampler(settings, vocab, seed=123)
    g = torch.Generator().manual_seed(9)
    counts = [0] * vocab
    for _ in range(n):
        if draft == "model":
            token = int(torch.multinomial(q, 1, generator=g))
            proposal: Optional[Tuple[int, Optional[torch.Tensor]]] = (token, q)
        else:
            proposal = (int(torch.randint(0, vocab, (1,), generator=g)), None)
        counts[choose(sampler, logits, proposal)] += 1
    assert counts[int(torch.argmin(p))] == 0  # top-k removed tokens are never chosen, whatever is proposed
    assert _p_value(counts, (p * n).tolist()) > P_THRESHOLD


def _exact_sequence_probs(lm: Any, prompt: List[int], settings: SamplerSettings,
                          steps: int) -> Dict[Tuple[int, ...], float]:
    """P(first `steps` tokens) under plain sampling: the sampler's own processed distribution after every prefix,
    with logits from a fresh full forward (no cache, no speculation)."""
    probs: Dict[Tuple[int, ...], float] = {(): 1.0}
    for _ in range(steps):
        nxt: Dict[Tuple[int, ...], float] = {}
        for prefix, mass in probs.items():
            ids = prompt + list(prefix)
            logits = lm.model.forward(torch.tensor([ids]), lm.model.new_cache())[0, -1]
            sampler = Sampler(settings, lm.config.vocab_size, seed=0)
            sampler.begin(ids)
            p = torch.softmax(sampler.warp(logits), dim=-1)
            for token in torch.nonzero(p > 0).flatten().tolist():
                nxt[prefix + (token,)] = mass * float(p[token])
        probs = nxt
    return probs


@pytest.mark.parametrize("mode, steps, top_k", [("ngram", 4, 2), ("near", 3, 3), ("other", 3, 3)])
def test_sampled_sequences_follow_plain_sampling(lm: Any, generators: Dict[str, Generator], mode: str, steps: int,
                                                 top_k: int) -> None:
    """A few sampled tokens (top-k, temperature, repetition penalty): top_k ** steps sequences whose exact
    probabilities come from the plain sampler; speculative draws must fit them. The prompt ends with the target's
    own greedy continuation, which repeats itself, so n-gram drafts are often right."""
    settings = SamplerSettings(temperature=0.9, top_k=top_k, rep_pen=1.3, rep_pen_mode="koboldcpp")
    start = _prompt(lm, 0, 8)[:8]
    prompt = start + generators["plain"].generate(GenerationRequest(start, 30, GREEDY, ban_eos=True)).token_ids
    exact = _exact_sequence_probs(lm, prompt, settings, steps)
    gen = generators[mode]
    n = 1500
    seen: Counter = Counter()
    accepted = drafted = 0
    for i in range(n):
        out = gen.generate(GenerationRequest(prompt, steps, settings, ban_eos=True, seed=1000 + i))
        seen[tuple(out.token_ids)] += 1
        accepted += gen.stats.speculation.accepted
        drafted += gen.stats.speculation.drafted
    if mode != "other":  # both the acceptance and the resampling branch must have run many times
        assert 0.1 * drafted < accepted < 0.9 * drafted
    keys = sorted(exact)
    assert set(seen) <= set(exact)
    assert _p_value([seen[k] for k in keys], [exact[k] * n for k in keys]) > P_THRESHOLD


# ---------------------------------------------------------------- drafters, tokenizer check, load options


def test_ngram_drafter_proposes_what_followed_the_latest_longest_match() -> None:
    d = NgramDrafter(max_n=3)
    assert d.propose([1, 2, 3, 4, 1, 2], 3).tokens == [3, 4, 1]
    assert d.propose([5, 6, 1, 2, 7, 1, 2, 9, 1, 2], 3).tokens == [9, 1, 2]  # the latest occurrence
    assert d.propose([1, 2, 3, 9, 2, 3, 5, 1, 2, 3], 2).tokens == [9, 2]  # the 3-gram beats a later 2-gram
    assert d.propose([1, 2, 3, 4, 5], 4).tokens == []
    assert d.propose([7, 7], 4).tokens == [7]  # the draft stops at the end of the context
    assert d.propose([1, 2, 1], 0).tokens == [] and d.propose([1], 3).tokens == []
    draft = d.propose([4, 8, 4], 5)
    assert draft.tokens == [8, 4] and draft.q == [None, None]  # point masses


class _Tok:
    def __init__(self, strings: List[str], bos: int = 1, eos: Sequence[int] = (2,)) -> None:
        self.strings, self.bos_id, self.eos_ids = strings, bos, list(eos)

    def token_strings(self) -> List[str]:
        return self.strings


def test_draft_tokenizer_mismatches_are_refused_in_one_sentence(lm: Any, checkpoints: Any) -> None:
    words = ["<unk>", "<s>", "</s>", "a", "b"]
    check_draft_tokenizer(_Tok(words), _Tok(list(words)))
    with pytest.raises(ModelFormatError, match="vocabulary of 4 tokens but the model has 5"):
        check_draft_tokenizer(_Tok(words), _Tok(words[:4]))
    with pytest.raises(ModelFormatError, match="reads token 4 as 'c'"):
        check_draft_tokenizer(_Tok(words), _Tok(words[:4] + ["c"]))
    with pytest.raises(ModelFormatError, match="EOS"):
        check_draft_tokenizer(_Tok(words), _Tok(words, eos=(3,)))
    other = checkpoints.get("llama3_rope").path  # a byte-level BPE tokenizer, the target has SentencePiece
    from kobold_backend.engine import loader

    def no_weights(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("weights were read before the tokenizers were compared")

    with pytest.MonkeyPatch.context() as mp, pytest.raises(ModelFormatError, match="must use the same tokenizer"):
        mp.setattr(loader, "_build", no_weights)
        load_model(checkpoints.get("dense_fp32").path, device="cpu", max_seq_len=64, speculative="draft",
                   draft_model=other)
    with pytest.raises(ModelFormatError, match="The draft model nowhere could not be loaded"):
        load_model(checkpoints.get("dense_fp32").path, device="cpu", max_seq_len=64, speculative="draft",
                   draft_model=checkpoints.get("dense_fp32").path.parent / "nowhere")
    with pytest.raises(RequestError, match="needs a draft model"):
        load_model(checkpoints.get("dense_fp32").path, device="cpu", speculative="draft")
    with pytest.raises(RequestError, match="speculative must be one of"):
        load_model(checkpoints.get("dense_fp32").path, device="cpu", speculative="fast")


def test_load_with_a_draft_model_and_ngram(checkpoints: Any) -> None:
    target = checkpoints.get("dense_fp32").path
    lm = load_model(target, device="cpu", max_seq_len=64, speculative="draft",
                    draft_model=checkpoints.get("dense_fp16").path, draft_tokens=3)
    assert lm.speculation.mode == "draft" and lm.speculation.draft_tokens == 3 and lm.draft is not None
    assert lm.draft.model.layers[0].device.type == "cpu"
    lm.unload()
    assert lm.draft is None
    lm = load_model(target, device="cpu", max_seq_len=64, speculative="ngram")
    assert lm.speculation.mode == "ngram" and lm.speculation.draft_tokens == 5 and lm.draft is None


def test_load_options_carry_speculation(checkpoints: Any) -> None:
    path = checkpoints.get("dense_fp32").path
    from kobold_backend.engine.config import ModelConfig

    ids = {p["id"]: p for p in requested_parameters(path, {"speculative": "ngram"}, gpus=[])}
    assert ids["speculative"]["default"] == "ngram" and ids["draft_model"]["uitype"] == "text"
    config = ModelConfig.from_dir(path)
    opts = load_options({"speculative": "draft", "draft_model": "/m/small", "draft_tokens": "6"}, config, gpus=[])
    assert opts.load_kwargs()["draft_model"] == "/m/small" and opts.load_kwargs()["draft_tokens"] == 6
    assert opts.values["speculative"] == "draft"
    assert "draft_model" not in load_options({"draft_model": "/m/small"}, config, gpus=[]).load_kwargs()
    assert "speculative" not in load_options({}, config, gpus=[]).load_kwargs()  # the server's flags apply
    off = load_options({"speculative": "off", "draft_model": "/m/small"}, config, gpus=[]).load_kwargs()
    assert off["speculative"] == "off" and "draft_model" not in off
    with pytest.raises(RequestError) as err:
        load_options({"speculative": "draft"}, config, gpus=[])
    assert err.value.field == "draft_model"
    with pytest.raises(RequestError):
        load_options({"speculative": "ngram", "draft_tokens": 99}, config, gpus=[])


def test_cli_flags_make_load_keywords() -> None:
    from kobold_backend.cli.model_args import speculation_kwargs

    def ns(**kw: Any) -> argparse.Namespace:
        return argparse.Namespace(**dict(dict(speculative=None, draft_model=None, draft_tokens=None), **kw))

    assert speculation_kwargs(ns()) == {}
    assert speculation_kwargs(ns(draft_model="d")) == {"speculative": "draft", "draft_model": "d"}
    assert speculation_kwargs(ns(speculative="ngram", draft_tokens=7)) == {"speculative": "ngram", "draft_tokens": 7}
    with pytest.raises(RequestError, match="goes with --speculative draft, not ngram"):
        speculation_kwargs(ns(speculative="ngram", draft_model="d"))


def test_perf_reports_speculation(lm: Any, generators: Dict[str, Generator]) -> None:
    from kobold_backend.server.generation import PerfStats

    gen = generators["self"]
    gen.generate(GenerationRequest(_prompt(lm, 2), 12, GREEDY, ban_eos=True))
    perf = PerfStats()
    perf.record(gen.stats)
    spec = perf.snapshot(0, True)["speculative"]
    assert spec["mode"] == "draft" and spec["fallback"] is None
    assert spec["accepted_tokens"] == spec["drafted_tokens"] > 0 and spec["acceptance_rate"] == 1.0
    assert spec["tokens_per_target_forward"] > 1.5
    perf.record(generators["plain"].stats)
    assert perf.snapshot(0, True)["speculative"] is None


def test_web_page_loads_a_draft_from_the_models_folder_only(checkpoints: Any, tmp_path: Any) -> None:
    import shutil

    from kobold_backend.server import ServerConfig, create_app
    from tests.server_helpers import make_holder

    target = checkpoints.get("dense_fp32").path
    models = tmp_path / "models"
    shutil.copytree(target, models / "tiny")
    shutil.copytree(checkpoints.get("dense_fp16").path, models / "small")
    (tmp_path / "outside").mkdir()
    shutil.copy(target / "config.json", tmp_path / "outside" / "config.json")
    app = create_app(ServerConfig(models_dir=models), make_holder(target))
    try:
        c = app.test_client()
        for name, status in (("../outside", 403), (str(tmp_path / "outside"), 403), ("absent", 404)):
            resp = c.post("/ui/load", json={"model": "tiny", "parameters": {"speculative": "draft",
                                                                             "draft_model": name}})
            assert resp.status_code == status, name
        missing = c.post("/ui/load", json={"model": "tiny", "parameters": {"speculative": "draft"}})
        assert missing.status_code == 422 and "draft_model" in missing.get_data(as_text=True)
        ok = c.post("/ui/load", json={"model": "tiny", "parameters": {"speculative": "draft", "draft_model": "small",
                                                                       "draft_tokens": 3}})
        assert ok.status_code == 200
        lm = app.extensions["kobold_backend"].holder.active.lm
        assert lm.draft is not None and lm.draft.path == (models / "small").resolve()
        out = c.post("/api/v1/generate", json={"prompt": "The old lighthouse", "max_length": 12,
                                                "temperature": 0.01, "use_default_badwordsids": True})
        assert out.status_code == 200
        spec = c.get("/api/extra/perf").get_json()["speculative"]
        assert spec["mode"] == "draft" and spec["drafted_tokens"] > 0 and spec["target_forwards"] > 0
        holder = app.extensions["kobold_backend"].holder
        holder.load_kwargs.update(speculative="draft", draft_model=str(models / "small"))  # as `serve --draft-model`
        off = c.post("/ui/load", json={"model": "tiny", "parameters": {"speculative": "off", "draft_model": "small"}})
        assert off.status_code == 200 and holder.active.lm.draft is None and holder.active.generator.speculator is None
    finally:
        app.extensions["kobold_backend"].close()


def test_generate_command_speculates_and_refuses_a_foreign_draft(checkpoints: Any, capsys: Any,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from kobold_backend.cli import main as cli

    target = str(checkpoints.get("dense_fp32").path)
    base = ["generate", "--model", target, "--device", "cpu", "--greedy", "--prompt", "a b a b a b",
            "--max-new-tokens", "6", "--max-context", "64"]
    with caplog.at_level(logging.INFO, logger="kobold_backend"):
        assert cli.main(base + ["--speculative", "ngram", "--draft-tokens", "3"]) == 0
    assert any(r.getMessage().startswith("speculation: ngram") for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="kobold_backend"):
        assert cli.main(base + ["--draft-model", str(checkpoints.get("llama3_rope").path)]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and "must use the same tokenizer" in errors[-1] and "\n" not in errors[-1]


def test_united_loads_with_a_draft_model(united: Any, checkpoints: Any) -> None:
    """United's command-line load (--model_parameters) with the speculative fields; the generator speculates."""
    target = checkpoints.get("dense_fp32").path
    params = {"max_ctx": 256, "0_Layers": 0, "CPU_Layers": 2, "speculative": "draft",
              "draft_model": str(checkpoints.get("dense_fp16").path), "draft_tokens": 2}
    backend = united.cli_load(str(target), "kobold_backend", str(target), params)
    spec = backend.generator.speculator
    assert spec is not None and spec.mode == "draft" and spec.k == 2
    assert len(backend.raw_generate("Hello", max_new=5).encoded[0]) == 5
    assert backend.generator.stats.speculation.target_forwards > 0
    backend.unload()
    plain = united.cli_load(str(target), "kobold_backend", str(target), {"max_ctx": 256, "0_Layers": 0,
                                                                          "CPU_Layers": 2, "speculative": "off"})
    assert plain.generator.speculator is None and plain.loaded.draft is None


def test_draft_logits_are_fitted_to_the_target_vocabulary(lm: Any) -> None:
    """Same tokenizer, other padding (Qwen2.5-0.5B has 151936 rows, its 7B 152064): padding ids are never drafted."""
    from kobold_backend.engine.drafters import ModelDrafter

    v = lm.config.vocab_size
    row = torch.randn(v)
    wider = ModelDrafter(lm.model, v + 5, 64, use_graphs=False)._logits(row)
    assert wider.shape == (v + 5,) and torch.equal(wider[:v], row) and torch.isinf(wider[v:]).all()
    narrower = ModelDrafter(lm.model, v - 3, 64, use_graphs=False)._logits(row)
    assert torch.equal(narrower, row[: v - 3])


def test_context_shift_keeps_greedy_identical(lm: Any, generators: Dict[str, Generator]) -> None:
    """A conversation trimmed in the middle: target and draft caches both shift instead of re-prefilling."""
    first = _prompt(lm, 31, 60) + _prompt(lm, 32, 40)
    outs = {}
    for name in ("plain", "near"):
        gen = generators[name]
        out = gen.generate(GenerationRequest(first, 8, GREEDY, ban_eos=True))
        trimmed = first[:10] + first[50:] + out.token_ids + _prompt(lm, 33, 4)
        outs[name] = gen.generate(GenerationRequest(trimmed, 12, GREEDY, ban_eos=True)).token_ids
        assert gen.stats.reused_tokens > 60, name  # the shift kept the cache after the cut
    assert outs["near"] == outs["plain"]
    draft_cache = generators["near"].speculator.drafter.lane.cache  # type: ignore[union-attr]
    assert draft_cache.tokens[: len(trimmed)] == trimmed
