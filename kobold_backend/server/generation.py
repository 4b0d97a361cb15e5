"""Generation jobs: turn validated params into engine requests on the worker thread, feed the text to the
job (streaming and /generate/check), and keep the counters of /api/extra/perf and the logprobs of
/api/extra/last_logprobs."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from kobold_backend.engine.request import GenerationRequest
from kobold_backend.server.errors import NoModelLoaded
from kobold_backend.server.logprobs import kobold_logprobs
from kobold_backend.server.queue import Job
from kobold_backend.server.schemas import GenerateParams, kobold_finish_reason, kobold_request

# KoboldCpp's stop_reason codes: -1 nothing yet, 0 out of tokens (or aborted), 1 EOS, 2 a stop string.
STOP_REASON_CODES = {"length": 0, "abort": 0, "stop": 1, "stop_string": 2}


@dataclass
class RunResult:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    passthrough_results: Optional[Dict[str, Any]] = None
    logprobs: Optional[Dict[str, Any]] = None  # KoboldCpp's shape, when the request asked for logprobs

    def as_kobold(self) -> Dict[str, Any]:
        out = {"text": self.text, "finish_reason": kobold_finish_reason(self.finish_reason),
               "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.passthrough_results is not None:
            out["passthrough_results"] = self.passthrough_results
        return out


class PerfStats:
    """The figures behind /api/extra/perf and /api/extra/last_logprobs, updated after every run."""

    def __init__(self) -> None:
        self.started = time.time()
        self.idle_since = time.time()
        self.lock = threading.Lock()
        self.last: Dict[str, Any] = {"last_process": 0.0, "last_eval": 0.0, "last_token_count": 0,
                                     "last_input_count": 0, "last_seed": -1, "stop_reason": -1}
        self.total_gens = 0
        self.last_logprobs: Optional[Dict[str, Any]] = None
        self.last_genkey: Optional[str] = None

    def record(self, stats: Any, passthrough: bool = False, logprobs: Optional[Dict[str, Any]] = None,
               genkey: Optional[str] = None) -> None:
        """After a run: its figures, and its logprobs (None when it did not ask for them) under its genkey."""
        with self.lock:
            self.last_logprobs = logprobs
            self.last_genkey = genkey or None
            self.total_gens += 1
            self.idle_since = time.time()
            self.last = {
                "last_process": round(float(stats.prefill_seconds), 6),
                "last_eval": round(float(stats.decode_seconds), 6),
                "last_token_count": int(stats.completion_tokens),
                "last_input_count": int(stats.prompt_tokens),
                "last_seed": -1 if stats.seed is None else int(stats.seed),
                "stop_reason": STOP_REASON_CODES.get(stats.finish_reason, -1),
                "passthrough": passthrough,  # the run was eager: no CUDA graph, no prefix reuse
                "speculative": _speculation(getattr(stats, "speculation", None)),
            }

    def logprobs_for(self, genkey: Optional[str]) -> Optional[Dict[str, Any]]:
        """The last run's logprobs: for anyone when that run had no genkey, else only for the same genkey."""
        with self.lock:
            if self.last_genkey is not None and genkey != self.last_genkey:
                return None
            return self.last_logprobs

    def snapshot(self, queued: int, idle: bool) -> Dict[str, Any]:
        now = time.time()
        with self.lock:
            out = dict(self.last)
            out.update({
                "total_gens": self.total_gens, "total_img_gens": 0, "queue": queued, "idle": 1 if idle else 0,
                "hordeexitcounter": 0, "uptime": round(now - self.started, 3),
                "idletime": round(now - self.idle_since, 3) if idle else 0.0, "quiet": False,
            })
        return out


def _speculation(s: Any) -> Optional[Dict[str, Any]]:
    """The run's speculative-decoding figures (None when the model speculates not at all)."""
    if s is None:
        return None
    return {"mode": s.mode, "fallback": s.fallback or None, "drafted_tokens": s.drafted,
            "accepted_tokens": s.accepted, "acceptance_rate": round(s.acceptance_rate, 4),
            "target_forwards": s.target_forwards, "tokens_per_target_forward": round(s.tokens_per_forward, 3),
            "backed_off_steps": s.backed_off}


class _SingleLine:
    """Cuts the output at its first newline (the generator stops there via a "\\n" stop string)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.cut = False

    def __call__(self, text: str) -> str:
        if not self.enabled or self.cut:
            return "" if self.cut else text
        at = text.find("\n")
        if at < 0:
            return text
        self.cut = True
        return text[:at]


def generation_job(holder: Any, params: GenerateParams, default_max_length: int,
                   perf: PerfStats, passthrough: Any = None) -> Callable[[Job], List[RunResult]]:
    """The function the worker runs for one /generate or /generate/stream request."""

    def run(job: Job) -> List[RunResult]:
        active = holder.active
        if active is None:
            raise NoModelLoaded()
        request = kobold_request(params, active.tokenizer, active.max_context, default_max_length,
                                 abort=job.abort_event)
        attached: List[Any] = [None]  # the passthrough of the completion that runs now

        def hooks(choice: GenerationRequest) -> Any:
            attached[0] = passthrough.attach(active, choice)
            return attached[0]

        results: List[RunResult] = []
        job.new_run()
        index = 0
        cut = _SingleLine(params.singleline)
        pieces: List[str] = []
        for item in active.generator.stream_choices(request, hooks if passthrough is not None else None):
            if item.index != index:  # the next completion starts: /generate/check shows its text
                job.new_run()
                index, cut, pieces = item.index, _SingleLine(params.singleline), []
            ev = item.event
            text = cut(ev.text)
            pieces.append(text)
            if item.stats is None:
                job.emit(text)
                continue
            logprobs = None if ev.logprobs is None else kobold_logprobs(active.tokenizer, ev.logprobs)
            job.emit(text, kobold_finish_reason(ev.finish_reason))
            pt = attached[0]
            perf.record(item.stats, passthrough=pt is not None, logprobs=logprobs, genkey=params.genkey)
            results.append(RunResult("".join(pieces), ev.finish_reason or "length", int(item.stats.prompt_tokens),
                                     int(item.stats.completion_tokens), pt.results() if pt is not None else None,
                                     logprobs))
        return results

    return run
