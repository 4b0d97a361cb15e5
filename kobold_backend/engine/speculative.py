"""Speculative decoding: a drafter guesses k tokens, the target scores them all in one forward, and the
generator accepts them position by position with the standard rejection rule.

The generator's loop stays one-token-at-a-time. After it picks token t, `Speculator.step(t)` drafts d1..dk and runs
the target on [t, d1..dk] at once, keeping the k+1 logits rows. The loop then meets each position with the row
for it and a proposal (d_i, q_i); `choose()` takes d_i with probability min(1, p(d_i)/q_i(d_i)) or draws from
norm(max(0, p - q_i)) (p: the target's distribution after every sampler transform; q_i: the draft's after the
same transforms, a point mass for n-gram drafts), so each token follows p exactly. With greedy settings it is
the argmax of p, as without speculation. A token other than d_i ends the round: the target cache is truncated
to the accepted prefix and the next step drafts afresh. Features that cannot be speculated (passthrough, a
negative prompt, beams, mirostat) decode plainly; the stats say which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

import torch

from kobold_backend.engine.drafters import Draft, ModelDrafter, NgramDrafter
from kobold_backend.engine.lane import Lane
from kobold_backend.engine.model import Model
from kobold_backend.engine.sampling import Sampler
from kobold_backend.errors import RequestError

if TYPE_CHECKING:
    from kobold_backend.engine.passthrough.base import ForwardHooks

MODES = ("off", "ngram", "draft")
DEFAULT_DRAFT_TOKENS = {"ngram": 5, "draft": 4}
MAX_DRAFT_TOKENS = 16
#: from the BACKOFF_AFTER-th round in a row whose drafts were all rejected, decode plainly for 1, 2, 4, ... steps
#: (up to MAX_BACKOFF) before drafting again; an accepted draft resets both. On text the drafter cannot guess a
#: verification forward is wasted work, and backing off keeps speculation near plain decoding's speed there.
BACKOFF_AFTER = 2
MAX_BACKOFF = 16

Drafter = Union[NgramDrafter, ModelDrafter]


@dataclass
class SpeculationConfig:
    """How a model speculates: `mode` "ngram" (prompt lookup) or "draft" (`draft_model`, same tokenizer), drafting
    up to `draft_tokens` per round (0: the mode's default)."""

    mode: str = "off"
    draft_tokens: int = 0
    draft_model: Optional[Model] = None
    draft_name: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculative mode must be one of {', '.join(MODES)}")
        if (self.mode == "draft") != (self.draft_model is not None):
            raise ValueError("a draft model goes with speculative mode 'draft', and only with it")
        if self.draft_tokens == 0 and self.mode != "off":
            self.draft_tokens = DEFAULT_DRAFT_TOKENS[self.mode]
        if self.mode != "off" and not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be in [1, {MAX_DRAFT_TOKENS}]")

    def describe(self) -> str:
        if self.mode == "off":
            return "off"
        what = f"draft model {self.draft_name}" if self.mode == "draft" else "n-gram prompt lookup"
        return f"{what}, {self.draft_tokens} tokens per round"


def check_speculation(mode: str, draft_model: object, draft_tokens: int) -> None:
    """Raise RequestError naming the option for load options that do not go together (before anything is read);
    a draft model with a mode other than "draft" is ignored."""
    if mode not in MODES:
        raise RequestError(f"speculative must be one of {', '.join(MODES)}, not {mode!r}", "speculative")
    if mode == "draft" and not draft_model:
        raise RequestError("speculative mode 'draft' needs a draft model folder", "draft_model")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 0 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise RequestError(f"draft_tokens must be a whole number in [1, {MAX_DRAFT_TOKENS}] (0: the mode's default)",
                           "draft_tokens")


def new_speculator(config: Optional[SpeculationConfig], lane: Lane, vocab_size: int,
                   use_graphs: bool) -> Optional[Speculator]:
    """The Speculator a Generator drives its lane with, or None when speculation is off."""
    if config is None or config.mode == "off":
        return None
    drafter: Drafter
    if config.draft_model is not None:
        drafter = ModelDrafter(config.draft_model, vocab_size, lane.cache.max_seq_len, use_graphs)
    else:
        drafter = NgramDrafter()
    return Speculator(lane, drafter, config.draft_tokens, config.mode)


@dataclass
class SpeculationStats:
    """What speculation did in one generation; `fallback` names why it was off for the request ("" when on)."""

    mode: str = "off"
    fallback: str = ""
    drafted: int = 0  # draft tokens the target scored
    accepted: int = 0  # of those, tokens taken as they were drafted
    target_forwards: int = 0  # decode forwards of the target (one per round, drafted or not)
    generated: int = 0  # tokens chosen while speculation was on
    backed_off: int = 0  # plain steps taken without asking the drafter, after rounds with nothing accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens produced per target decode forward: the speed-up bound when drafting were free."""
        return self.generated / self.target_forwards if self.target_forwards else 0.0


    def describe(self) -> str:
        """One log line: what was drafted and accepted, or why the request decoded plainly."""
        if self.fallback:
            return f"{self.mode} off for this request ({self.fallback})"
        return (f"{self.mode}: {self.accepted}/{self.drafted} drafted tokens accepted "
                f"({100.0 * self.acceptance_rate:.1f} %), {self.tokens_per_forward:.2f} tokens per target forward, "
                f"{self.backed_off} plain steps backed off")


def fallback_reason(*, passthrough: bool, negative_prompt: bool, beams: bool, mirostat: bool,
                    recurrent: bool = False) -> str:
    """Why a request decodes without speculation ("" when it can be speculated)."""
    if recurrent:
        return "linear-attention model (its recurrent state cannot take back rejected draft tokens)"
    if beams:
        return "beam search"
    if passthrough:
        return "passthrough"
    if negative_prompt:
        return "negative prompt (CFG)"
    if mirostat:
        return "mirostat"
    return ""


def start_speculation(
    speculator: Optional[Speculator], prompt: Sequence[int], budget: int, sampler: Sampler, context_shift: bool, *,
    passthrough: bool, negative_prompt: bool, beams: bool, recurrent: bool = False,
) -> Tuple[Optional[Speculator], Optional[SpeculationStats]]:
    """(the speculator begun on this request or None, the stats the request reports: None without speculation,
    a fallback entry when the request uses a feature that cannot be speculated)."""
    if speculator is None:
        return None, None
    reason = fallback_reason(passthrough=passthrough, negative_prompt=negative_prompt, beams=beams,
                             mirostat=sampler.settings.mirostat != 0, recurrent=recurrent)
    if reason:
        return None, SpeculationStats(mode=speculator.mode, fallback=reason)
    speculator.begin(prompt, budget, sampler, context_shift)
    return speculator, speculator.stats


def choose(sampler: Sampler, scores: torch.Tensor, proposal: Optional[Tuple[int, Optional[torch.Tensor]]]) -> int:
    """The token at a position: the sampler's own pick, or the rejection rule when a draft proposed one.

    p is the sampler's final distribution (every transform applied, as `sample` would draw from); q the draft's
    distribution (None: a point mass on the proposed token). Accept d with probability min(1, p(d)/q(d)),
    otherwise draw from max(0, p - q) renormalised: the result is distributed exactly as p.
    """
    if proposal is None or sampler.settings.temperature <= 0.0:
        return sampler.sample(scores)
    token, q = proposal
    p = torch.softmax(sampler.warp(scores), dim=-1)
    if q is not None:
        q = q.to(p.device)
    u = torch.rand((), generator=sampler.generator, device=p.device)
    # u < p/q written without the division; one host read decides
    if bool((u * (1.0 if q is None else q[token]) < p[token]).item()):
        return token
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    residual = torch.where(residual.sum() > 0.0, residual, p)  # p == q up to rounding: rejection had probability ~0
    return int(torch.multinomial(residual, 1, generator=sampler.generator).item())


class Speculator:
    """The target lane's decode steps with drafting; one per Generator, reused across requests."""

    def __init__(self, lane: Lane, drafter: Drafter, draft_tokens: int, mode: str) -> None:
        if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be in [1, {MAX_DRAFT_TOKENS}]")
        self.lane = lane
        self.drafter = drafter
        self.k = draft_tokens
        self.mode = mode
        self.stats = SpeculationStats(mode=mode)
        self._context: List[int] = []
        self._rows: Optional[torch.Tensor] = None  # target logits after t, d1, ..., dm
        self._draft: Draft = Draft([], [])
        self._next = 0  # index into the draft of the token proposed at the current position
        self._base = 0  # cache position of t (the round's first fed token)
        self._prompt_len = 0
        self._budget = 0
        self._misses = 0  # rounds in a row that accepted nothing
        self._backoff = 0  # plain steps to take after the next such round
        self._skip = 0  # plain steps still to take before drafting again

    def begin(self, context: Sequence[int], budget: int, sampler: Sampler, context_shift: bool) -> None:
        """Start a request whose prompt (already in the target cache) is `context`, producing at most `budget`."""
        self.stats = SpeculationStats(mode=self.mode)
        self._context = list(context)
        self._prompt_len = len(self._context)
        self._budget = budget
        self._misses = self._backoff = self._skip = 0
        self._drop_round()
        self.drafter.begin(sampler, context_shift)

    @property
    def proposal(self) -> Optional[Tuple[int, Optional[torch.Tensor]]]:
        """(token, q) the draft proposes at the current position, or None."""
        if self._rows is None or self._next >= len(self._draft.tokens):
            return None
        return self._draft.tokens[self._next], self._draft.q[self._next]

    def pick(self, sampler: Sampler, scores: torch.Tensor) -> int:
        """The token at the current position (see choose), counted in the stats."""
        token = choose(sampler, scores, self.proposal)
        self.stats.generated += 1
        if self.proposal is not None:
            self.stats.drafted += 1
            if token == self._draft.tokens[self._next]:
                self.stats.accepted += 1
        return token

    def step(self, token: int, passthrough: Optional[ForwardHooks] = None) -> torch.Tensor:
        """Logits after `token` (Lane.step's contract; never with a passthrough): a row of the current round when
        it is the drafted one, else a new round that drafts at most as many tokens as the budget still needs."""
        self._context.append(token)
        if self.proposal is not None and token == self._draft.tokens[self._next]:
            self._next += 1
            return self._rows[self._next]  # type: ignore[index]
        if self._rows is not None:  # rejected (or the round is used up): forget the drafts after the prefix
            self.lane.cache.truncate(self._base + self._next + 1)
            self._pace(accepted=self._next)
        self._drop_round()
        cache = self.lane.cache
        remaining = self._budget - (len(self._context) - self._prompt_len)
        k = min(self.k, remaining - 1, cache.max_seq_len - cache.seq_len - 1)
        if self._skip > 0:
            self._skip -= 1
            self.stats.backed_off += 1
            k = 0
        draft = self.drafter.propose(self._context, k) if k > 0 else Draft([], [])
        self.stats.target_forwards += 1
        if not draft.tokens:
            return self.lane.step(token, None)
        self._base = cache.seq_len
        self._rows = self.lane.rows([token] + draft.tokens)
        self._draft = draft
        self._next = 0
        return self._rows[0]

    def rewind_to(self, length: int, passthrough: Optional[ForwardHooks] = None) -> torch.Tensor:
        """Keep `length` positions of the target (prompt + kept tokens) and return the logits that follow."""
        self._drop_round()
        del self._context[length:]
        return self.lane.rewind_to(length, None)

    def _pace(self, accepted: int) -> None:
        """After a round: back off (doubling, up to MAX_BACKOFF plain steps) from the BACKOFF_AFTER-th round in a
        row that accepted nothing."""
        if accepted:
            self._misses = self._backoff = 0
            return
        self._misses += 1
        if self._misses >= BACKOFF_AFTER:
            self._backoff = min(max(1, 2 * self._backoff), MAX_BACKOFF)
            self._skip = self._backoff

    def _drop_round(self) -> None:
        self._rows = None
        self._draft = Draft([], [])
        self._next = 0
