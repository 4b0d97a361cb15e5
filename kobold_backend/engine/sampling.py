"""Token sampling: SamplerSettings (KoboldAI United and KoboldCpp fields, derived from engine/sampler_fields.py) and
the Sampler over logits.

The pipeline for one token (docs/samplers.md has the details and where each rule comes from):
logit_bias and bans -> DRY -> the samplers of `sampler_order` (ids 0-6) -> XTC -> draw; with mirostat
1 or 2 the order is replaced by repetition penalty -> temperature -> mirostat. Everything runs on the
logits' device; per-token state (penalty positions, DRY matches, mirostat mu) is kept there and updated
by `accept`, so the only host transfer per token is the chosen id.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import field, make_dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from kobold_backend.engine.sampler_fields import MAX_MAGNITUDE, REP_PEN_MODES, SAMPLER_FIELDS, SAMPLER_IDS, SamplerField
from kobold_backend.engine.samplers import mirostat as _mirostat
from kobold_backend.engine.samplers import temperature as _temperature
from kobold_backend.engine.samplers import truncation as _truncation
from kobold_backend.engine.samplers.candidates import NEG_INF, Candidates, draw
from kobold_backend.engine.samplers.dry import DryPenalty, parse_sequence_breakers
from kobold_backend.engine.samplers.penalties import RepetitionPenalty
from kobold_backend.engine.samplers.xtc import xtc, xtc_enabled
from kobold_backend.errors import RequestError

__all__ = ["REP_PEN_MODES", "SamplerSettings", "Sampler", "parse_sequence_breakers", "benchmark_samplers"]

LOGIT_BIAS_LIMIT = 100.0
_TYPES = {"number": float, "integer": int, "choice": str, "int_list": Tuple[int, ...],
          "string_list": Tuple[str, ...], "bias_map": Dict[int, float], "id_list": Tuple[int, ...]}


def _checked_value(f: SamplerField, value: Any) -> None:
    """RequestError(message, field) when one value is not of its field's type or outside its range."""
    name = f.name
    if f.kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RequestError(f"{name} must be a finite number", name)
        if abs(value) > MAX_MAGNITUDE:
            raise RequestError(f"{name} must be between -{MAX_MAGNITUDE:g} and {MAX_MAGNITUDE:g}", name)
    elif f.kind == "integer":
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(f"{name} must be an integer", name)
    elif f.kind == "choice":
        if value not in f.choices:
            raise RequestError(f"{name} must be one of {', '.join(f.choices)}", name)
        return
    elif f.kind == "string_list":
        if not isinstance(value, (list, tuple)) or not all(isinstance(b, str) for b in value):
            raise RequestError(f"{name} must be a list of strings", name)
        return
    elif f.kind == "int_list":
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i in SAMPLER_IDS for i in value
        ):
            raise RequestError(f"{name} must list sampler ids 0-6", name)
        if len(set(value)) != len(value):
            raise RequestError(f"{name} repeats a sampler id", name)
        return
    elif f.kind == "bias_map":
        for token, bias in value.items():
            if isinstance(token, bool) or not isinstance(token, int):
                raise RequestError(f"{name} keys must be token ids", name)
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise RequestError(f"{name} values must be finite numbers", name)
        return
    elif f.kind == "id_list":
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise RequestError(f"{name} must be token ids", name)
        return
    low, high = f.minimum, f.maximum
    if low is not None and high is not None and not low <= value <= high:
        raise RequestError(f"{name} must be between {low:g} and {high:g}", name)
    if low is not None and (value <= low if f.above else value < low):
        raise RequestError(f"{name} must be {'>' if f.above else '>='} {low:g}", name)
    if high is not None and value > high:
        raise RequestError(f"{name} must be <= {high:g}", name)


def _validate(self: Any) -> None:
    """Raise RequestError(message, field) for the first bad value (engine ranges of engine/sampler_fields.py).
    Settings are immutable, so they are checked once: later calls (the generator's, the Sampler's) return at once."""
    if self.__dict__.get("_valid"):
        return
    for f in SAMPLER_FIELDS:
        _checked_value(f, getattr(self, f.name))
    if self.dry_multiplier > 0.0 and self.dry_base <= 0.0:
        raise RequestError("dry_base must be > 0", "dry_base")
    object.__setattr__(self, "_valid", True)


def _field(f: SamplerField) -> Tuple[str, Any, Any]:
    default = f.default
    spec = field(default_factory=dict) if isinstance(default, dict) else field(default=default)
    return f.name, _TYPES[f.kind], spec


SamplerSettings = make_dataclass(
    "SamplerSettings", [_field(f) for f in SAMPLER_FIELDS], frozen=True, namespace={
        "__doc__": "Every sampling field of KoboldAI United and KoboldCpp (engine/sampler_fields.py declares them); "
                   "each default switches its sampler off.",
        "__module__": __name__,
        "validate": _validate,
    })


class Sampler:
    """Applies the configured samplers to one logits vector per token and keeps the per-request state."""

    def __init__(
        self,
        settings: SamplerSettings,
        vocab_size: int,
        device: Union[torch.device, str] = "cpu",
        seed: Optional[int] = None,
        token_texts: Optional[List[str]] = None,
        banned: Sequence[int] = (),
    ) -> None:
        settings.validate()
        s = settings
        self.settings = settings
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # torch seeds are 64-bit: larger seeds are taken modulo 2^64.
        self.seed = int(seed) % 2**64 if seed is not None and seed >= 0 else int.from_bytes(os.urandom(4), "little")
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)
        self.context: List[int] = []
        self._inputs = (settings, vocab_size, token_texts, tuple(banned))  # what twin() builds another from
        # On the CPU, drop removed candidates between samplers (host reads are free there); tests may
        # switch it off to run the fixed-shape accelerator path on the CPU.
        self.compact = self.device.type == "cpu"
        self._greedy = s.temperature <= 0.0
        self._bias, self._has_bans = self._build_bias(s, banned)
        self._penalty = RepetitionPenalty(
            s.rep_pen_mode, s.rep_pen, s.rep_pen_range, s.rep_pen_slope, s.presence_penalty,
            s.frequency_penalty, vocab_size, self.device,
        )
        self._dry = DryPenalty(
            s.dry_multiplier, s.dry_base, s.dry_allowed_length, s.dry_penalty_last_n,
            s.dry_sequence_breakers, vocab_size, self.device, token_texts,
        )
        self._steps = tuple(i for i in s.sampler_order if self._step_active(i))
        self._xtc = s.mirostat == 0 and xtc_enabled(s.xtc_threshold, s.xtc_probability)
        self._mu = torch.tensor(2.0 * s.mirostat_tau, dtype=torch.float32, device=self.device)
        self.begin([])

    def twin(self, device: Union[torch.device, str], seed: int) -> Sampler:
        """A sampler with this one's settings, vocabulary, token texts and bans but its own device and random
        stream (a draft model samples through the request's transforms with it)."""
        settings, vocab_size, token_texts, banned = self._inputs
        return Sampler(settings, vocab_size, device, seed=seed, token_texts=token_texts, banned=banned)

    def _build_bias(self, s: SamplerSettings, extra: Sequence[int]) -> Tuple[Optional[torch.Tensor], bool]:
        """One additive tensor: clamped logit biases, -inf on banned ids (the settings' and `extra`, the
        generator's EOS and single-character bans; ids outside the vocabulary are ignored)."""
        bias = {t: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(b))) for t, b in s.logit_bias.items()
                if 0 <= t < self.vocab_size}
        banned = sorted({t for t in (*s.banned_token_ids, *extra) if 0 <= t < self.vocab_size})
        if not bias and not banned:
            return None, False
        values = torch.zeros(self.vocab_size, dtype=torch.float32)
        for token, b in bias.items():
            values[token] = b
        if banned:
            values[torch.tensor(banned, dtype=torch.long)] = NEG_INF
        return values.to(self.device), bool(banned)

    def _step_active(self, sampler_id: int) -> bool:
        s = self.settings
        return {
            0: s.top_k > 0,
            1: s.top_a > 0.0,
            2: s.top_p < 1.0 or s.min_p > 0.0,
            3: s.tfs < 1.0,
            4: s.typical < 1.0,
            5: self._greedy or s.temperature != 1.0 or s.dynatemp_range > 0.0 or s.smoothing_factor > 0.0,
            6: self._penalty.active,
        }[sampler_id]

    @property
    def mirostat_mu(self) -> float:
        """The current mirostat target surprise mu (reads it from the device; for diagnostics and tests)."""
        return float(self._mu.item())

    def begin(self, context_ids: List[int]) -> None:
        """Start a request on this prompt; resets penalty positions, DRY history and mirostat mu."""
        self.context = [int(t) for t in context_ids]
        self._penalty.reset(self.context)
        self._dry.reset(self.context)
        self._mu.fill_(2.0 * self.settings.mirostat_tau)

    def accept(self, token_id: int) -> None:
        """Append a generated (or forced) token to the context."""
        self.context.append(int(token_id))
        self._penalty.push(self.context)
        self._dry.push(self.context)

    def rewind(self, n: int) -> None:
        """Forget the last n accepted tokens (the state is rebuilt from the remaining context)."""
        if n <= 0:
            return
        del self.context[max(0, len(self.context) - n) :]
        self._penalty.reset(self.context)
        self._dry.reset(self.context)

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """The final logits [V] (vocabulary order, removed tokens -inf) that `sample` would draw from.

        Draws the XTC roll like `sample` does, so interleaving the two changes the random stream.
        """
        return self._warp(self._prepare(logits)).to_vocab(self.vocab_size)

    def sample(self, logits: torch.Tensor) -> int:
        """Pick the next token id from raw logits [V] (float32 on the sampler's device)."""
        c = self._warp(self._prepare(logits))
        if self._greedy:
            pos = torch.argmax(c.vals).reshape(1)
            probs = None
        else:
            pos, probs = draw(c, self.generator)
        if self.settings.mirostat:
            chosen = c.probs()[pos] if probs is None else probs[pos]
            self._mu = _mirostat.update_mu(self._mu, chosen, self.settings.mirostat_tau, self.settings.mirostat_eta)
        return int(c.token_at(pos).item())

    def _prepare(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.reshape(-1)
        if x.numel() != self.vocab_size:
            raise ValueError(f"expected {self.vocab_size} logits, got {x.numel()}")
        x = x.to(device=self.device, dtype=torch.float32)
        if self._bias is not None:
            biased = x + self._bias
            if self._has_bans:
                # Every remaining token banned: drop the bans for this token rather than fail.
                biased = torch.where((biased > NEG_INF).any(), biased, x)
            x = biased
        return self._dry.apply(x)

    def _warp(self, x: torch.Tensor) -> Candidates:
        s = self.settings
        c = Candidates(x, host=self.compact)
        if s.mirostat:
            self._penalty.apply(c)
            if self._greedy:
                _temperature.greedy(c)
            else:
                _temperature.temperature(c, s.temperature, s.smoothing_factor)
            if s.mirostat == 1:
                _mirostat.mirostat_v1(c, self._mu, self.vocab_size)
            else:
                _mirostat.mirostat_v2(c, self._mu)
            return c
        for sampler_id in self._steps:
            if sampler_id == 0:
                _truncation.top_k(c, s.top_k)
            elif sampler_id == 1:
                _truncation.top_a(c, s.top_a)
            elif sampler_id == 2:
                if s.top_p < 1.0:
                    _truncation.top_p(c, s.top_p)
                if s.min_p > 0.0:
                    _truncation.min_p(c, s.min_p)
            elif sampler_id == 3:
                _truncation.tail_free(c, s.tfs)
            elif sampler_id == 4:
                _truncation.typical(c, s.typical)
            elif sampler_id == 5:
                if self._greedy:
                    # One candidate left: nothing later (penalties, truncation, XTC) can change the pick.
                    _temperature.greedy(c)
                    return c
                if s.dynatemp_range > 0.0:
                    _temperature.dynamic_temperature(
                        c, s.temperature, s.dynatemp_range, s.dynatemp_exponent, s.smoothing_factor
                    )
                else:
                    _temperature.temperature(c, s.temperature, s.smoothing_factor)
            else:
                self._penalty.apply(c)
            if sampler_id <= 4:
                c.compact()
        if self._xtc and not self._greedy:
            xtc(c, s.xtc_threshold, s.xtc_probability, self.generator)
        return c


def _benchmark_settings(mode: str) -> SamplerSettings:
    """Every sampler switched on at typical strengths (the XTC roll always fires)."""
    return SamplerSettings(
        temperature=0.8, top_k=200, top_p=0.95, top_a=0.02, tfs=0.97, typical=0.95, min_p=0.02,
        rep_pen=1.1, rep_pen_range=1024, rep_pen_slope=0.7, rep_pen_mode=mode, presence_penalty=0.1,
        frequency_penalty=0.1, dynatemp_range=0.3, smoothing_factor=0.2, dry_multiplier=0.8,
        dry_penalty_last_n=1024, xtc_threshold=0.1, xtc_probability=1.0,
        logit_bias={1: 2.0, 2: -3.0}, banned_token_ids=(0,),
    )


def benchmark_samplers(
    vocab_size: int, device: Union[torch.device, str] = "cpu", steps: int = 50, context_len: int = 2048
) -> Dict[str, object]:
    """Per-token cost (sample + accept, ms) of default settings vs every sampler on, on random logits.

    The context repeats itself so that the penalties and DRY have work to do. Keys: `default_ms` (all off),
    `greedy_ms`, `lite_defaults_ms` (KoboldAI Lite's usual settings), `all_united_ms` / `all_koboldcpp_ms`
    (every sampler on, each repetition-penalty rule), `mirostat2_ms`, plus the inputs.
    """
    dev = torch.device(device)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(1234)
    logits = (torch.randn(steps + 2, vocab_size, generator=gen) * 3.0).to(dev)
    phrase = torch.randint(0, vocab_size, (64,), generator=gen).tolist()
    context = (phrase * (context_len // len(phrase) + 1))[:context_len]
    texts = [f"t{i}" if i % 97 else "\n" for i in range(vocab_size)]
    cases = {
        "default_ms": SamplerSettings(),
        "greedy_ms": SamplerSettings(temperature=0.0),
        "lite_defaults_ms": SamplerSettings(temperature=0.7, top_k=100, top_p=0.92, rep_pen=1.07,
                                            rep_pen_range=360, rep_pen_slope=0.7, rep_pen_mode="koboldcpp"),
        "all_united_ms": _benchmark_settings("kobold_united"),
        "all_koboldcpp_ms": _benchmark_settings("koboldcpp"),
        "mirostat2_ms": SamplerSettings(mirostat=2, temperature=0.8, rep_pen=1.1, rep_pen_range=1024,
                                        rep_pen_mode="koboldcpp"),
    }
    result: Dict[str, object] = {"vocab_size": vocab_size, "device": str(dev), "steps": steps,
                                 "context_len": context_len}
    for name, settings in cases.items():
        sampler = Sampler(settings, vocab_size, dev, seed=7, token_texts=texts)
        sampler.begin(context)
        for row in logits[:2]:
            sampler.accept(sampler.sample(row))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        for row in logits[2:]:
            sampler.accept(sampler.sample(row))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        result[name] = (time.perf_counter() - start) * 1000.0 / steps
    return result
