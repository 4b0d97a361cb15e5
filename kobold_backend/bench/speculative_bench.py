"""Speculative decoding on one checkpoint: plain greedy decode against n-gram drafting and a draft model, on a
repetitive and a random prompt, with the acceptance rate, tokens per target forward and the measured speed-up.

Synthetic checkpoints have random weights, so a separate synthetic draft model agrees with its target about as
often as chance: that run is the cost bound when every draft is rejected. The target drafting for itself
accepts everything: that run bounds the verification overhead. The components (plain step, draft step, a
verification forward of k+1 tokens) are timed too, and `predicted_speedup` gives the speed-up a draft of this
cost would reach at a few acceptance rates: tokens per round (1 - a^(k+1)) / (1 - a) over the round's time
k * t_draft + t_verify, against t_plain per token.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from kobold_backend.bench.timing import random_ids, sync, timed
from kobold_backend.engine.decode_graph import graphs_supported
from kobold_backend.engine.lane import Lane
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.model import Model
from kobold_backend.engine.sampling import Sampler, SamplerSettings
from kobold_backend.engine.speculative import SpeculationConfig, new_speculator

ACCEPTANCE_RATES = (0.5, 0.7, 0.8, 0.9)


def _prompts(vocab: int, length: int) -> Dict[str, List[int]]:
    """'repetitive': a 48-token phrase said over and over; 'random': uniform ids (nothing to look up)."""
    phrase = random_ids(48, vocab, 5)[0].tolist()
    return {"repetitive": (phrase * (length // len(phrase) + 1))[:length],
            "random": random_ids(length, vocab, 6)[0].tolist()}


def _greedy_run(model: Model, prompt: List[int], steps: int, use_graphs: bool,
                speculation: Optional[SpeculationConfig]) -> Dict[str, Any]:
    """Greedy decode of `steps` tokens after `prompt` through the generator's own lane/speculator path."""
    lane = Lane(model, model.new_cache(), use_graphs)
    spec = new_speculator(speculation, lane, model.config.vocab_size, use_graphs)
    sampler = Sampler(SamplerSettings(temperature=0), model.config.vocab_size, model.device, seed=0)

    def run() -> List[int]:
        lane.cache.reset()
        logits = lane.feed(prompt, None)
        sampler.begin(prompt)
        driver: Any = lane
        if spec is not None:
            spec.begin(prompt, steps, sampler, False)
            driver = spec
        out: List[int] = []
        while True:
            token = sampler.sample(logits) if spec is None else spec.pick(sampler, logits)
            sampler.accept(token)
            out.append(token)
            if len(out) >= steps:
                return out
            logits = driver.step(token, None)

    run()  # warm-up: graph capture, kernel selection
    lane.cache.reset()
    dev = model.device
    prefill = timed(lambda: lane.feed(prompt, None), dev)
    tokens: List[List[int]] = []
    total = timed(lambda: tokens.append(run()), dev)
    result: Dict[str, Any] = {"tokens_per_s": steps / max(total - prefill, 1e-9), "tokens": tokens[0]}
    if spec is not None:
        s = spec.stats
        result.update(acceptance_rate=s.acceptance_rate, drafted=s.drafted, accepted=s.accepted,
                      tokens_per_target_forward=s.tokens_per_forward, backed_off_steps=s.backed_off)
    return result


def _step_seconds(model: Model, context: int, use_graphs: bool, tokens: int = 1, repeats: int = 5) -> float:
    """Seconds of one decode step (tokens == 1) or one verification forward of `tokens` ids, each a graph replay
    when possible (Lane.step, Lane.rows)."""
    lane = Lane(model, model.new_cache(), use_graphs)
    ids = random_ids(context, model.config.vocab_size, 3)[0].tolist()
    lane.feed(ids, None)
    dev = model.device
    extra = random_ids(tokens, model.config.vocab_size, 4)[0].tolist()

    def once() -> None:
        lane.cache.truncate(context)
        if tokens == 1:
            lane.step(extra[0], None)
        else:
            lane.rows(extra)

    once()
    return min(timed(once, dev) for _ in range(repeats))


def bench_speculation(path: str, draft_path: Optional[str], device: str = "auto", draft_tokens: int = 4,
                      prompt_length: int = 512, steps: int = 128, use_graphs: bool = True,
                      max_seq_len: int = 2048) -> Dict[str, Any]:
    """Plain, n-gram, draft-model and self-draft greedy decoding on a repetitive and a random prompt."""
    lm = load_model(path, device=device, max_seq_len=max_seq_len, with_tokenizer=False)
    model = lm.model
    graphs = use_graphs and graphs_supported(model)
    draft = None
    if draft_path is not None:
        draft = load_model(draft_path, device=str(model.device), max_seq_len=max_seq_len, with_tokenizer=False)
    configs: Dict[str, Optional[SpeculationConfig]] = {
        "plain": None,
        "ngram": SpeculationConfig("ngram", draft_tokens),
        "self_draft": SpeculationConfig("draft", draft_tokens, model, "the target itself"),
    }
    if draft is not None:
        configs["draft"] = SpeculationConfig("draft", draft_tokens, draft.model, draft.name)
    result: Dict[str, Any] = {"device": str(model.device), "graphs": graphs, "draft_tokens": draft_tokens,
                              "prompt_length": prompt_length, "steps": steps,
                              "draft_weights_bytes": None if draft is None else draft.model.nbytes}
    for text, prompt in _prompts(model.config.vocab_size, prompt_length).items():
        runs = {name: _greedy_run(model, prompt, steps, graphs, config) for name, config in configs.items()}
        plain = runs["plain"]
        for name, run in runs.items():
            run["identical_to_plain"] = run.pop("tokens") == plain["tokens"] if name != "plain" else True
            if name != "plain":
                run["speedup"] = run["tokens_per_s"] / plain["tokens_per_s"]
        plain.pop("tokens", None)
        result[text] = runs
    t_plain = _step_seconds(model, prompt_length, graphs)
    t_verify = _step_seconds(model, prompt_length, graphs, tokens=draft_tokens + 1)
    components = {"plain_step_s": t_plain, "verify_forward_s": t_verify, "verify_over_step": t_verify / t_plain}
    if draft is not None:
        t_draft = _step_seconds(draft.model, prompt_length, graphs)
        components["draft_step_s"] = t_draft
        k = draft_tokens
        components["predicted_speedup"] = {
            str(a): t_plain * (1 - a ** (k + 1)) / (1 - a) / (k * t_draft + t_verify) for a in ACCEPTANCE_RATES}
    result["components"] = components
    sync(model.device)
    if draft is not None:
        draft.unload()
    lm.unload()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def format_speculation(r: Dict[str, Any]) -> List[str]:
    """Summary lines for the bench table."""
    lines = [f"speculation (k={r['draft_tokens']}, {r['steps']} greedy tokens after {r['prompt_length']}):"]
    for text in ("repetitive", "random"):
        parts = []
        for name, run in r[text].items():
            if name == "plain":
                parts.append(f"plain {run['tokens_per_s']:.1f} tok/s")
            else:
                parts.append(f"{name} x{run['speedup']:.2f} (accept {100 * run['acceptance_rate']:.0f} %"
                             f"{'' if run['identical_to_plain'] else ', DIFFERS'})")
        lines.append(f"  {text:10s} " + ", ".join(parts))
    c = r["components"]
    line = (f"  plain step {c['plain_step_s'] * 1e3:.2f} ms, verify forward {c['verify_forward_s'] * 1e3:.2f} ms "
            f"({c['verify_over_step']:.2f}x)")
    if "draft_step_s" in c:
        line += f", draft step {c['draft_step_s'] * 1e3:.2f} ms; predicted x" + ", x".join(
            f"{v:.2f} at {float(a):.0%}" for a, v in c["predicted_speedup"].items())
    lines.append(line)
    return lines
