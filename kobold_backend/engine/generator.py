"""The one generation API both hosts use: GenerationRequest -> iterator of TokenEvent.

It reuses the cached prefix of the previous prompt, samples token by token, holds back text that
may become a stop string or a banned phrase, rewinds and resamples when a banned phrase completes,
and stops on EOS, length, a stop string or an abort.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from kobold_backend.engine.cache import KVCache
from kobold_backend.engine.decode_graph import GraphDecoder, graphs_supported
from kobold_backend.engine.model import Model
from kobold_backend.engine.sampling import Sampler, SamplerSettings
from kobold_backend.engine.tokenizer import Tokenizer
from kobold_backend.errors import OutOfContextError, RequestError

PREFILL_CHUNK = 2048
SHIFT_MIN_MATCH = 32
MAX_BAN_REWINDS = 64


@dataclass
class GenerationRequest:
    prompt_ids: List[int]
    max_new_tokens: int
    settings: SamplerSettings = field(default_factory=SamplerSettings)
    stop_strings: Sequence[str] = ()
    ban_eos: bool = False
    bypass_eos: bool = False
    seed: Optional[int] = None
    passthrough: Optional[Any] = None
    abort: Optional[threading.Event] = None
    banned_strings: Sequence[str] = ()
    trim_stop: bool = True


@dataclass
class TokenEvent:
    """One step: `text` is what may be shown now (possibly ""), `finish_reason` is set on the last event."""

    text: str
    token_id: Optional[int]
    finish_reason: Optional[str] = None


@dataclass
class GenerationOutput:
    text: str
    token_ids: List[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int
    prefill_seconds: float
    decode_seconds: float


@dataclass
class GenerationStats:
    """Figures of the last generation (KoboldCpp's /api/extra/perf reads these)."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finish_reason: str = ""
    seed: Optional[int] = None
    total_generations: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def find_shift(
    cached: Sequence[int], new: Sequence[int], min_match: int = SHIFT_MIN_MATCH
) -> Optional[Tuple[int, int]]:
    """(start, drop) when `new` is `cached` with a span cut out after the common prefix (a trimmed front of a
    conversation, memory kept): dropping cached[start:start+drop] then lets the rest of the cache be reused.
    The kept run must be at least `min_match` tokens, or as long as what is left of either sequence."""
    start = common_prefix(cached, new)
    need = min(min_match, len(new) - start - 1)
    if need < 1 or start >= len(cached):
        return None
    probe = list(new[start : start + need])
    for drop in range(1, len(cached) - start - need + 1):
        if cached[start + drop] == probe[0] and list(cached[start + drop : start + drop + need]) == probe:
            return start, drop
    return None


class _TextTracker:
    """Generated token bytes, what was emitted, and hold-back for stop strings and banned phrases."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str], banned: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s.encode("utf-8") for s in stop_strings if s]
        self.banned = [re.compile(re.escape(s), re.IGNORECASE) for s in banned if len(s) > 1]
        self.banned_text = [s.lower() for s in banned if len(s) > 1]
        self.buf = bytearray()
        self.starts: List[int] = []
        self.emitted = 0

    def push(self, token_id: int) -> None:
        self.starts.append(len(self.buf))
        self.buf += self.tokenizer.token_bytes(token_id)

    def truncate(self, n_tokens: int) -> None:
        cut = self.starts[n_tokens]
        del self.buf[cut:]
        del self.starts[n_tokens:]

    def complete_end(self) -> int:
        """Byte length of the longest prefix of buf that ends on a whole UTF-8 character."""
        data = self.buf
        for back in range(1, min(4, len(data)) + 1):
            byte = data[-back]
            if byte & 0xC0 == 0x80:
                continue
            need = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
            return len(data) - back if need > back else len(data)
        return len(data)

    def find_stop(self) -> Optional[Tuple[int, int]]:
        """(start, end) bytes of the earliest complete stop string at or after the emitted text."""
        best: Optional[Tuple[int, int]] = None
        for stop in self.stops:
            at = self.buf.find(stop, max(0, self.emitted - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, at + len(stop))
        return best

    def find_banned(self) -> Optional[int]:
        """Index of the generated token where a completed banned phrase starts, if any."""
        text = bytes(self.buf[: self.complete_end()]).decode("utf-8", errors="replace")
        for pattern in self.banned:
            match = pattern.search(text)
            if match:
                byte_at = len(text[: match.start()].encode("utf-8"))
                for i in range(len(self.starts) - 1, -1, -1):
                    if self.starts[i] <= byte_at:
                        return i
                return 0
        return None

    def safe_end(self) -> int:
        """How far text may be emitted: not into a partial character or a possible stop/banned prefix."""
        end = self.complete_end()
        tail = bytes(self.buf[self.emitted : end])
        hold = end
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(tail)), 0, -1):
                if tail.endswith(stop[:k]):
                    hold = min(hold, end - k)
                    break
        if self.banned_text:
            text = tail.decode("utf-8", errors="replace").lower()
            for phrase in self.banned_text:
                for k in range(min(len(phrase) - 1, len(text)), 0, -1):
                    if text.endswith(phrase[:k]):
                        hold = min(hold, end - len(text[-k:].encode("utf-8")))
                        break
        return max(hold, self.emitted)

    def take(self, end: int) -> str:
        text = bytes(self.buf[self.emitted : end]).decode("utf-8", errors="replace")
        self.emitted = max(self.emitted, end)
        return text


class Generator:
    """Runs requests one at a time on a model and its KV cache."""

    def __init__(
        self, model: Model, tokenizer: Tokenizer, cache: Optional[KVCache] = None, use_graphs: Optional[bool] = None
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache if cache is not None else model.new_cache()
        if use_graphs is None:
            use_graphs = graphs_supported(model)
        self.graph = GraphDecoder(model, self.cache) if use_graphs else None
        self.lock = threading.Lock()
        self.stats = GenerationStats()
        self.context_shift = True
        self._char_bans: Dict[str, Tuple[int, ...]] = {}

    @property
    def max_context(self) -> int:
        return self.cache.max_seq_len

    def generate(self, req: GenerationRequest) -> GenerationOutput:
        pieces: List[str] = []
        ids: List[int] = []
        reason = "length"
        for event in self.stream(req):
            pieces.append(event.text)
            if event.token_id is not None:
                ids.append(event.token_id)
            if event.finish_reason is not None:
                reason = event.finish_reason
        s = self.stats
        return GenerationOutput("".join(pieces), ids, reason, s.prompt_tokens, s.completion_tokens,
                                s.reused_tokens, s.prefill_seconds, s.decode_seconds)

    def stream(self, req: GenerationRequest) -> Iterator[TokenEvent]:
        """Yield a TokenEvent per sampled token and a final one; close the iterator to stop early."""
        self._check(req)
        with self.lock:
            yield from self._run(req)

    def _check(self, req: GenerationRequest) -> None:
        req.settings.validate()
        if req.max_new_tokens < 1:
            raise RequestError("max_new_tokens must be at least 1", "max_length")
        if len(req.prompt_ids) >= self.cache.max_seq_len:
            raise OutOfContextError(
                f"The prompt has {len(req.prompt_ids)} tokens but the context holds {self.cache.max_seq_len}; "
                "trim it or load the model with a larger context."
            )
        vocab = self.model.config.vocab_size
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt")

    def _banned_ids(self, req: GenerationRequest) -> Tuple[int, ...]:
        ids = set(req.settings.banned_token_ids)
        if req.ban_eos:
            ids.update(self.tokenizer.eos_ids)
        for s in req.banned_strings:
            if len(s) == 1:
                ids.update(self._tokens_containing(s))
        return tuple(sorted(ids))

    def _tokens_containing(self, char: str) -> Tuple[int, ...]:
        if char not in self._char_bans:
            low = char.lower()
            strings = self.tokenizer.token_strings()
            self._char_bans[char] = tuple(i for i, s in enumerate(strings) if low in s.lower())
        return self._char_bans[char]

    def _feed(self, ids: Sequence[int], passthrough: Optional[Any]) -> torch.Tensor:
        """Run ids through the model at the end of the cache; returns the last position's logits [V]."""
        logits = None
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = list(ids[start : start + PREFILL_CHUNK])
            x = torch.tensor([chunk], dtype=torch.long, device=self.model.embed_tokens.device)
            logits = self.model.forward(x, self.cache, passthrough=passthrough)
            self.cache.tokens.extend(chunk)
        assert logits is not None
        return logits[0, -1]

    def _step(self, token: int, passthrough: Optional[Any]) -> torch.Tensor:
        """Feed one sampled token: a CUDA-graph replay when possible (passthrough runs eager)."""
        if self.graph is None or passthrough is not None:
            return self._feed([token], passthrough)
        logits = self.graph.step(token)
        self.cache.tokens.append(token)
        return logits

    def _run(self, req: GenerationRequest) -> Iterator[TokenEvent]:
        cache = self.cache
        prompt = list(req.prompt_ids) or ([self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else [0])
        room = cache.max_seq_len - len(prompt)
        budget = min(req.max_new_tokens, room)
        t0 = time.perf_counter()
        if req.passthrough is not None:
            cache.reset()
        elif self.context_shift:
            shift = find_shift(cache.tokens, prompt)
            if shift is not None:
                self.model.shift_cache(cache, *shift)
        reuse = min(common_prefix(cache.tokens, prompt), len(prompt) - 1)
        cache.truncate(reuse)
        logits = self._feed(prompt[reuse:], req.passthrough)
        settings = req.settings
        banned = self._banned_ids(req)
        if banned:
            settings = _with_bans(settings, banned)
        sampler = Sampler(settings, self.model.config.vocab_size, logits.device, seed=req.seed,
                          token_texts=self.tokenizer.token_strings())
        sampler.begin(prompt)
        t1 = time.perf_counter()
        tracker = _TextTracker(self.tokenizer, req.stop_strings, req.banned_strings)
        generated: List[int] = []
        position_bans: Dict[int, Set[int]] = {}
        rewinds = 0
        eos = set(self.tokenizer.eos_ids)
        reason = "length"
        try:
            while True:
                if req.abort is not None and req.abort.is_set():
                    reason = "abort"
                    break
                extra = position_bans.get(len(generated))
                if extra:
                    logits = logits.clone()
                    logits[list(extra)] = float("-inf")
                token = sampler.sample(logits)
                sampler.accept(token)
                generated.append(token)
                if token in eos and not req.bypass_eos:
                    reason = "stop"
                    yield TokenEvent("", token)
                    break
                tracker.push(token)
                if tracker.banned and rewinds < MAX_BAN_REWINDS:
                    start = tracker.find_banned()
                    if start is not None:
                        rewinds += 1
                        position_bans.setdefault(start, set()).add(generated[start])
                        sampler.rewind(len(generated) - start)
                        tracker.truncate(start)
                        del generated[start:]
                        cache.truncate(len(prompt) + start - 1)
                        logits = self._feed([(prompt + generated)[-1]], req.passthrough)
                        continue
                stop = tracker.find_stop()
                if stop is not None:
                    reason = "stop_string"
                    text = tracker.take(stop[0] if req.trim_stop else stop[1])
                    yield TokenEvent(text, token)
                    break
                yield TokenEvent(tracker.take(tracker.safe_end()), token)
                if len(generated) >= budget:
                    break
                logits = self._step(token, req.passthrough)
            tail = "" if reason == "stop_string" else tracker.take(len(tracker.buf))
            yield TokenEvent(tail, None, reason)
        finally:
            t2 = time.perf_counter()
            self.stats = GenerationStats(
                prompt_tokens=len(prompt), reused_tokens=reuse, completion_tokens=len(generated),
                prefill_seconds=t1 - t0, decode_seconds=t2 - t1, finish_reason=reason, seed=req.seed,
                total_generations=self.stats.total_generations + 1,
            )


def _with_bans(settings: SamplerSettings, banned: Tuple[int, ...]) -> SamplerSettings:
    return replace(settings, banned_token_ids=tuple(sorted(set(settings.banned_token_ids) | set(banned))))
