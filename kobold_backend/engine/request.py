"""The one request the engine runs, whatever dialect it arrived in, and the one policy that fits it into the context.

Every dialect converts its body to a GenerationRequest in one small function: KoboldAI and KoboldCpp
(`server.schemas.kobold_request`), OpenAI (`server.openai_schemas.openai_request`), KoboldAI United
(`host.backend.KoboldBackendMixin._united_request`) and the command line (`cli.main.generate_request`). The lengths
and prompt trimming they need are the functions below, so each rule is written once:

- `request_context`: the context one request may use (its own size, capped by the loaded model's).
- `clamp_new_tokens`: a requested length clamped so the prompt keeps min(context - 4, 16) tokens (KoboldCpp's rule,
  used by /api and /v1/completions).
- `new_tokens_to_fill`: a length that the prompt must fit beside whole (/v1/chat/completions and United's "generate
  until the context is full" requests).
- `fit_text` / `fit_ids`: the prompt trimmed from its front to a token budget (memory and a leading BOS kept).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

from kobold_backend.engine.sampling import SamplerSettings
from kobold_backend.errors import OutOfContextError, RequestError

if TYPE_CHECKING:
    from kobold_backend.engine.passthrough.base import ForwardHooks

MAX_SEED = 2**64 - 1
PROMPT_RESERVE = 16  # tokens the prompt keeps at least (fewer in contexts under 20 tokens)
# Stop strings and banned phrases are matched against the output at every token: their number and length are bounded.
MAX_MATCH_STRINGS = 64
MAX_MATCH_CHARS = 512


@dataclass
class GenerationRequest:
    """What to generate: the prompt's token ids, how many tokens, the sampler settings, the stops and bans, the
    constraints (grammar, beams, classifier-free guidance), the forward hooks and the number of completions `n`
    (completion i uses seed + i; `choices` splits the request into them, each with its own grammar state)."""

    prompt_ids: List[int]
    max_new_tokens: int
    settings: SamplerSettings = field(default_factory=SamplerSettings)
    stop_strings: Sequence[str] = ()
    ban_eos: bool = False
    bypass_eos: bool = False
    seed: Optional[int] = None
    passthrough: Optional[ForwardHooks] = None
    abort: Optional[threading.Event] = None
    banned_strings: Sequence[str] = ()
    trim_stop: bool = True
    negative_prompt_ids: Sequence[int] = ()
    guidance_scale: float = 1.0
    num_beams: int = 1
    beam_length: int = 8
    grammar: Optional[Any] = None  # engine.grammar.GrammarConstraint: one per request, it holds the grammar state
    logprobs: Optional[int] = None  # report log p of each generated token and its N most likely alternatives
    n: int = 1

    def __post_init__(self) -> None:
        for name in ("stop_strings", "banned_strings"):
            strings = getattr(self, name)
            if len(strings) > MAX_MATCH_STRINGS:
                raise RequestError(f"{name} has {len(strings)} strings (at most {MAX_MATCH_STRINGS})", name)
            for i, text in enumerate(strings):
                if len(text) > MAX_MATCH_CHARS:
                    raise RequestError(f"{name}[{i}] has {len(text)} characters (at most {MAX_MATCH_CHARS})", name)

    def choices(self) -> List[GenerationRequest]:
        """The n single completions: completion i has seed + i (modulo 2^64; a random first seed when none was
        given, or a negative one), everything else shared."""
        seed = resolve_seed(self.seed)
        return [replace(self, n=1, seed=(seed + i) % (MAX_SEED + 1),
                        grammar=self.grammar if i == 0 or self.grammar is None else self.grammar.copy())
                for i in range(self.n)]


def resolve_seed(seed: Optional[int]) -> int:
    """The seed itself, or a random one for None or a negative seed (KoboldAI's -1)."""
    return seed if seed is not None and seed >= 0 else random.getrandbits(63)


# -- the context-fitting policy ----------------------------------------------------------------------------------

def request_context(model_context: int, requested: Optional[int] = None) -> int:
    """The context a request may use: its own size when it gives one, never more than the model's, at least 2."""
    return max(2, model_context if requested is None else min(requested, model_context))


def clamp_new_tokens(context: int, wanted: int) -> int:
    """`wanted` new tokens clamped so that min(context - 4, 16) tokens (and never fewer than one) stay for the
    prompt."""
    reserve = max(1, min(context - 4, PROMPT_RESERVE))
    return max(1, min(wanted, context - reserve))


def new_tokens_to_fill(context: int, prompt_len: int, wanted: Optional[int] = None) -> int:
    """New tokens beside a whole prompt: `wanted` (default: the rest of the context), at most what fits;
    OutOfContextError when the prompt leaves no room."""
    room = context - prompt_len
    if room < 1:
        raise OutOfContextError(f"This model's context holds {context} tokens, but the prompt takes {prompt_len}.")
    return room if wanted is None else min(wanted, room)


def fit_text(tokenizer: Any, memory: str, prompt: str, budget: int) -> List[int]:
    """Token ids of BOS (when the tokenizer adds one) + memory + prompt in at most `budget` tokens; the prompt
    loses tokens from its front first, then the memory does. Texts are tokenized from their end
    (engine.tokenizer.encode_tail), so a prompt far longer than the context costs what the kept part costs."""
    from kobold_backend.engine.tokenizer import encode_tail

    bos = [int(i) for i in tokenizer.prefix_ids]
    keep = max(0, budget - len(bos))
    joint, whole = encode_tail(tokenizer, memory + prompt, keep)
    if whole:
        return bos + joint
    mem, _ = encode_tail(tokenizer, memory, keep) if memory else ([], True)
    room = keep - len(mem)
    body, _ = encode_tail(tokenizer, prompt, room)
    return bos + mem + body


def fit_ids(ids: Sequence[int], budget: int, bos_id: Optional[int]) -> List[int]:
    """Prompt ids in at most `budget` tokens: the oldest go first, a leading BOS stays."""
    ids = list(ids)
    if len(ids) <= budget:
        return ids
    head = ids[:1] if bos_id is not None and ids and ids[0] == bos_id else []
    return head + ids[len(ids) - (budget - len(head)):]


def fit_lengths(model_context: int, wanted: int, requested_context: Optional[int] = None) -> Tuple[int, int]:
    """(prompt budget, new tokens) of a request that asks for `wanted` new tokens in `requested_context` (KoboldCpp's
    rule: the length is clamped, then the prompt is trimmed to what is left)."""
    context = request_context(model_context, requested_context)
    new = clamp_new_tokens(context, wanted)
    return context - new, new
