"""The one generation API every host uses: GenerationRequest (engine/request.py) -> iterator of TokenEvent.

It reuses the cached prefix of the previous prompt, samples token by token, holds back text that
may become a stop string or a banned phrase, rewinds and resamples when a banned phrase completes,
and stops on EOS, length, a stop string or an abort.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from kobold_backend.engine.beam import BeamSearch
from kobold_backend.engine.cache import KVCache
from kobold_backend.engine.decode_graph import graphs_supported
from kobold_backend.engine.lane import Lane
from kobold_backend.engine.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from kobold_backend.engine.model import Model
from kobold_backend.engine.request import GenerationRequest
from kobold_backend.engine.sampling import Sampler
from kobold_backend.engine.speculative import (
    SpeculationConfig,
    SpeculationStats,
    Speculator,
    new_speculator,
    start_speculation,
)
from kobold_backend.engine.tokenizer import Tokenizer, complete_utf8_prefix
from kobold_backend.errors import OutOfContextError, RequestError

if TYPE_CHECKING:
    from kobold_backend.engine.passthrough.base import ForwardHooks

log = logging.getLogger(__name__)

MAX_BAN_REWINDS = 64
MAX_BEAMS = 16
MAX_BEAM_LENGTH = 64


@dataclass
class TokenEvent:
    """One step: `text` is what may be shown now (possibly ""), `finish_reason` is set on the last event. When the
    request asked for logprobs, the last event's `logprobs` has one TokenLogprob per generated token (tokens taken
    back by a banned-phrase rewind and the final EOS are not in it)."""

    text: str
    token_id: Optional[int]
    finish_reason: Optional[str] = None
    logprobs: Optional[List[TokenLogprob]] = None


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
    logprobs: Optional[List[TokenLogprob]] = None


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
    speculation: Optional[SpeculationStats] = None  # None when the model was loaded without speculation


@dataclass
class ChoiceEvent:
    """One event of completion `index` of a request with n completions (Generator.stream_choices); the event that
    ends the completion carries that completion's figures in `stats`."""

    index: int
    event: TokenEvent
    stats: Optional[GenerationStats] = None


def _fold(text: str) -> str:
    """`text` lower-cased character by character, its length kept (a character whose lower case is longer, such as
    "İ", stays as it is), so offsets into it are offsets into `text`."""
    lowered = text.lower()
    if len(lowered) == len(text):
        return lowered
    return "".join(c if len(c.lower()) != 1 else c.lower() for c in text)


class _TextTracker:
    """Generated token bytes, what was emitted, and hold-back for stop strings and banned phrases (matched without
    regard to case; each token looks only at the text a phrase ending in it can cover)."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str], banned: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s.encode("utf-8") for s in stop_strings if s]
        self.banned = [_fold(s) for s in banned if len(s) > 1]
        self.longest = max((len(s) for s in self.banned), default=0)
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
        return complete_utf8_prefix(self.buf)

    def find_stop(self) -> Optional[Tuple[int, int]]:
        """(start, end) bytes of the earliest complete stop string at or after the emitted text."""
        best: Optional[Tuple[int, int]] = None
        for stop in self.stops:
            at = self.buf.find(stop, max(0, self.emitted - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, at + len(stop))
        return best

    def find_banned(self) -> Optional[int]:
        """Index of the generated token where a banned phrase completed by the latest token starts, if any (one
        completed earlier was found then). Only the last `longest` characters before that token are searched (up
        to 4 bytes each, and 3 bytes of a character the token may complete), so the work per token is bounded by
        the phrases, not by the length of the output."""
        end = self.complete_end()
        start = max(0, (self.starts[-1] if self.starts else 0) - 4 * self.longest - 3)
        while start < end and self.buf[start] & 0xC0 == 0x80:
            start += 1  # a window starts on a whole character
        text = _fold(bytes(self.buf[start:end]).decode("utf-8", errors="replace"))
        found = [at for at in (text.find(phrase) for phrase in self.banned) if at >= 0]
        if not found:
            return None
        byte_at = start + len(text[: min(found)].encode("utf-8"))
        for i in range(len(self.starts) - 1, -1, -1):
            if self.starts[i] <= byte_at:
                return i
        return 0

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
        if self.banned:
            text = _fold(tail.decode("utf-8", errors="replace"))
            for phrase in self.banned:
                for k in range(min(len(phrase) - 1, len(text)), 0, -1):
                    if text.endswith(phrase[:k]):
                        hold = min(hold, end - len(text[-k:].encode("utf-8")))
                        break
        return max(hold, self.emitted)

    def take(self, end: int) -> str:
        text = bytes(self.buf[self.emitted : end]).decode("utf-8", errors="replace")
        self.emitted = max(self.emitted, end)
        return text


class RowStream:
    """One row of a lockstep batch (Generator.stream_rows): its events, the first one possibly fetched early."""

    def __init__(self, stream: Iterator[TokenEvent]) -> None:
        self._stream = stream
        self._pending: Optional[TokenEvent] = None

    def prime(self) -> None:
        """Fetch the first event now (this runs the prompt's prefill)."""
        self._pending = next(self._stream)

    def __iter__(self) -> Iterator[TokenEvent]:
        return self

    def __next__(self) -> TokenEvent:
        event, self._pending = self._pending, None
        return event if event is not None else next(self._stream)

    def close(self) -> None:
        close = getattr(self._stream, "close", None)
        if close is not None:
            close()


class Generator:
    """Runs requests one at a time on a model and its KV cache."""

    def __init__(
        self, model: Model, tokenizer: Tokenizer, cache: Optional[KVCache] = None, use_graphs: Optional[bool] = None
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.use_graphs = graphs_supported(model) if use_graphs is None else use_graphs
        self.lane = Lane(model, cache if cache is not None else model.new_cache(), self.use_graphs)
        self.speculator: Optional[Speculator] = None
        self.cfg_lane: Optional[Lane] = None
        self.last_beam_search: Optional[BeamSearch] = None
        self.lock = threading.Lock()
        self.stats = GenerationStats()
        self.context_shift = True
        self._char_bans: Dict[str, Tuple[int, ...]] = {}

    def use_speculation(self, config: Optional[SpeculationConfig]) -> None:
        """Decode speculatively as `config` says from the next request on (None: plainly)."""
        self.speculator = new_speculator(config, self.lane, self.model.config.vocab_size, self.use_graphs)

    @property
    def cache(self) -> KVCache:
        return self.lane.cache

    @property
    def max_context(self) -> int:
        return self.cache.max_seq_len

    def generate(self, req: GenerationRequest) -> GenerationOutput:
        pieces: List[str] = []
        ids: List[int] = []
        reason = "length"
        logprobs = None
        for event in self.stream(req):
            pieces.append(event.text)
            if event.token_id is not None:
                ids.append(event.token_id)
            if event.finish_reason is not None:
                reason = event.finish_reason
                logprobs = event.logprobs
        s = self.stats
        return GenerationOutput("".join(pieces), ids, reason, s.prompt_tokens, s.completion_tokens,
                                s.reused_tokens, s.prefill_seconds, s.decode_seconds, logprobs)

    def stream(self, req: GenerationRequest) -> Iterator[TokenEvent]:
        """Yield a TokenEvent per sampled token and a final one; close the iterator to stop early. One completion:
        a request with n > 1 is run by `stream_choices` (one after another) or `stream_rows` (in lockstep)."""
        if req.n != 1:
            raise RequestError("stream runs one completion; use stream_choices or stream_rows",
                               "n")
        self._check(req)
        with self.lock:
            yield from self._run(req)

    def stream_choices(self, req: GenerationRequest,
                       hooks: Optional[Callable[[GenerationRequest], Optional[ForwardHooks]]] = None
                       ) -> Iterator[ChoiceEvent]:
        """The n completions of `req` one after another (completion i has seed + i, see GenerationRequest.choices),
        each a run of its own on this generator's cache (prefix reuse, CUDA graphs, stats), so each equals the
        single request with its seed. `hooks(choice)` gives a completion its own forward hooks. Once `req.abort`
        is set, the completions that have not started are skipped. Close the iterator to stop early."""
        self._check(req)
        for i, choice in enumerate(req.choices()):
            if i and req.abort is not None and req.abort.is_set():
                return
            if hooks is not None:
                choice = replace(choice, passthrough=hooks(choice))
            last: Optional[TokenEvent] = None
            for event in self.stream(choice):
                if event.finish_reason is not None:
                    last = event  # the run's figures are final once its stream has ended
                else:
                    yield ChoiceEvent(i, event)
            if last is not None:
                yield ChoiceEvent(i, last, replace(self.stats))

    def stream_rows(self, req: GenerationRequest,
                    hooks: Optional[Callable[[int], Optional[ForwardHooks]]] = None) -> List[RowStream]:
        """The n completions of `req` as streams to be advanced in lockstep (a batch): row 0 runs on this
        generator's cache and has prefilled the prompt when this returns; rows 1..n-1 each get a cache of their own
        started from a copy of that prefill (eager, no CUDA graphs). `hooks(row)` gives a row its own forward hooks
        (they hold per-request state). Close every row when done."""
        self._check(req)
        choices = req.choices()
        if hooks is not None:
            choices = [replace(c, passthrough=hooks(i)) for i, c in enumerate(choices)]
        first = RowStream(self.stream(choices[0]))
        rows = [first]
        try:
            first.prime()
            need = len(req.prompt_ids) + req.max_new_tokens
            for choice in choices[1:]:
                cache = self.model.new_cache(max_seq_len=min(need, self.max_context))
                cache.copy_from(self.cache, length=min(self.cache.seq_len, cache.max_seq_len))
                row = Generator(self.model, self.tokenizer, cache=cache, use_graphs=False)
                rows.append(RowStream(row.stream(choice)))
        except BaseException:
            for row in rows:
                row.close()
            raise
        return rows

    def _check(self, req: GenerationRequest) -> None:
        req.settings.validate()
        if req.n < 1:
            raise RequestError("n must be at least 1", "n")
        if req.max_new_tokens < 1:
            raise RequestError("max_new_tokens must be at least 1", "max_length")
        if len(req.prompt_ids) >= self.cache.max_seq_len:
            raise OutOfContextError(
                f"The prompt has {len(req.prompt_ids)} tokens but the context holds {self.cache.max_seq_len}; "
                "trim it or load the model with a larger context."
            )
        vocab = self.model.config.vocab_size
        for name, ids in (("prompt", req.prompt_ids), ("negative_prompt", req.negative_prompt_ids)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"{name} token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", name)
        if req.negative_prompt_ids and len(req.negative_prompt_ids) >= self.cache.max_seq_len:
            raise OutOfContextError("The negative prompt does not fit in the context.")
        if not 0.0 <= req.guidance_scale <= 100.0:
            raise RequestError("guidance_scale must be in [0, 100]", "guidance_scale")
        if not 1 <= req.num_beams <= MAX_BEAMS:
            raise RequestError(f"num_beams must be in [1, {MAX_BEAMS}]", "num_beams")
        if not 1 <= req.beam_length <= MAX_BEAM_LENGTH:
            raise RequestError(f"beam_length must be in [1, {MAX_BEAM_LENGTH}]", "beam_length")
        if req.num_beams > 1 and (req.negative_prompt_ids or req.passthrough is not None):
            raise RequestError("beam search cannot be combined with a negative prompt or passthrough", "num_beams")
        if req.num_beams > 1 and self.model.recurrent:
            raise RequestError("beam search is not available for this model: its linear-attention layers keep one "
                               "recurrent state, which beams cannot share", "num_beams")
        if req.num_beams > 1 and req.grammar is not None:
            raise RequestError("beam search cannot be combined with a grammar", "num_beams")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
        if req.num_beams > 1 and req.logprobs is not None:
            raise RequestError("beam search cannot be combined with logprobs", "num_beams")

    def _cfg_lane(self, req: GenerationRequest) -> Optional[Lane]:
        """The negative prompt's lane for classifier-free guidance, its cache allocated on first use."""
        if not req.negative_prompt_ids or req.guidance_scale == 1.0:
            return None
        if self.cfg_lane is None:
            self.cfg_lane = Lane(self.model, self.model.new_cache(self.cache.max_seq_len), self.use_graphs)
        return self.cfg_lane

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

    def _run(self, req: GenerationRequest) -> Iterator[TokenEvent]:
        cache = self.cache
        prompt = list(req.prompt_ids) or ([self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else [0])
        room = cache.max_seq_len - len(prompt)
        budget = min(req.max_new_tokens, room)
        t0 = time.perf_counter()
        begin = getattr(req.passthrough, "begin", None)  # optional member of ForwardHooks
        if begin is not None:
            begin(len(prompt))
        guide_passthrough = _guide_view(req.passthrough)
        logits, reuse = self.lane.prepare(prompt, req.passthrough, self.context_shift)
        guide = self._cfg_lane(req)
        guide_logits = logits
        if guide is not None:
            guide_logits, _ = guide.prepare(list(req.negative_prompt_ids), guide_passthrough, self.context_shift)
        banned = self._banned_ids(req)
        sampler = Sampler(req.settings, self.model.config.vocab_size, logits.device, seed=req.seed,
                          token_texts=self.tokenizer.token_strings(), banned=banned)
        sampler.begin(prompt)
        spec, spec_stats = start_speculation(
            self.speculator, prompt, budget, sampler, self.context_shift,
            passthrough=req.passthrough is not None, negative_prompt=guide is not None, beams=req.num_beams > 1,
            recurrent=self.model.recurrent)
        driver = self.lane if spec is None else spec  # the target's decode steps and rewinds
        beams = None
        if req.num_beams > 1:
            self.last_beam_search = BeamSearch(self.lane, logits, req.num_beams, req.beam_length, banned)
            beams = self.last_beam_search.tokens(budget)
        t1 = time.perf_counter()
        tracker = _TextTracker(self.tokenizer, req.stop_strings, req.banned_strings)
        generated: List[int] = []
        logprobs: List[TokenLogprob] = []  # one per token in `generated` when the request asked for them
        position_bans: Dict[int, Set[int]] = {}
        rewinds = 0
        eos = set(self.tokenizer.eos_ids)
        reason = "length"
        try:
            while True:
                if req.abort is not None and req.abort.is_set():
                    reason = "abort"
                    break
                if beams is not None:
                    token = next(beams)
                else:
                    extra = position_bans.get(len(generated))
                    scores = logits if guide is None else classifier_free_guidance(
                        logits, guide_logits, req.guidance_scale)
                    if extra and req.grammar is None:  # after the CFG mix: -inf there is never 0 * -inf
                        scores = scores.clone()
                        scores[list(extra)] = float("-inf")
                    if req.grammar is not None:
                        # -inf where the grammar rejects the token; it takes the position bans too
                        scores = req.grammar.constrain(scores, extra or ())
                    token = sampler.sample(scores) if spec is None else spec.pick(sampler, scores)
                    sampler.accept(token)
                    if req.logprobs is not None:
                        logprobs.append(token_logprobs(logits, token, req.logprobs))
                    if req.grammar is not None:
                        req.grammar.accept(token)
                generated.append(token)
                if token in eos and not req.bypass_eos:
                    reason = "stop"
                    if req.logprobs is not None:
                        del logprobs[len(generated) - 1:]  # the end of text is not part of the output
                    yield TokenEvent("", token)
                    break
                tracker.push(token)
                if tracker.banned and beams is None and rewinds < MAX_BAN_REWINDS:
                    start = tracker.find_banned()
                    if start is not None:
                        rewinds += 1
                        position_bans.setdefault(start, set()).add(generated[start])
                        sampler.rewind(len(generated) - start)
                        if req.grammar is not None:
                            req.grammar.rollback(len(generated) - start)
                        tracker.truncate(start)
                        del generated[start:]
                        del logprobs[start:]
                        logits = driver.rewind_to(len(prompt) + start, req.passthrough)
                        if guide is not None:
                            guide_logits = guide.rewind_to(len(req.negative_prompt_ids) + start, guide_passthrough)
                        continue
                stop = tracker.find_stop()
                if stop is not None:
                    reason = "stop_string"
                    text = tracker.take(stop[0] if req.trim_stop else stop[1])
                    yield TokenEvent(text, token)
                    break
                yield TokenEvent(tracker.take(tracker.safe_end()), token)
                if req.grammar is not None and req.grammar.is_finished():
                    reason = "stop"  # the grammar is complete and allows nothing more
                    break
                if len(generated) >= budget:
                    break
                if beams is not None:
                    continue
                logits = driver.step(token, req.passthrough)
                if guide is not None:
                    guide_logits = guide.step(token, guide_passthrough)
            tail = "" if reason == "stop_string" else tracker.take(len(tracker.buf))
            yield TokenEvent(tail, None, reason, logprobs if req.logprobs is not None else None)
        finally:
            t2 = time.perf_counter()
            self.stats = GenerationStats(
                prompt_tokens=len(prompt), reused_tokens=reuse, completion_tokens=len(generated),
                prefill_seconds=t1 - t0, decode_seconds=t2 - t1, finish_reason=reason, seed=sampler.seed,
                total_generations=self.stats.total_generations + 1, speculation=spec_stats,
            )
            if spec_stats is not None:
                log.info("speculation: %s", spec_stats.describe())


def _guide_view(passthrough: Optional[ForwardHooks]) -> Optional[ForwardHooks]:
    """What the negative prompt's lane runs: the same actions, minus capture (see engine/passthrough)."""
    if passthrough is None:
        return None
    view = getattr(passthrough, "guide_view", None)
    return view() if view is not None else passthrough


def classifier_free_guidance(logits: torch.Tensor, negative: torch.Tensor, scale: float) -> torch.Tensor:
    """Mix the prompt's and the negative prompt's next-token distributions in log space:
    log p_neg + scale * (log p - log p_neg); scale 1 is the prompt alone, 0 the negative prompt alone."""
    pos = torch.log_softmax(logits.float(), dim=-1)
    neg = torch.log_softmax(negative.float(), dim=-1)
    return neg + scale * (pos - neg)
