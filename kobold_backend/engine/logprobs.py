"""Per-token log-probabilities of a generation: the chosen token's and the N most likely alternatives', from the
model's own next-token distribution.

The distribution is log_softmax of the model's logits for that position (float32), before anything the request
changes: logit bias and bans, repetition penalties, temperature, truncation samplers, grammar, classifier-free
guidance. So the figures describe the model, not the sampler, and are the same for any sampler settings; this is
what OpenAI's `logprobs` report and what llama.cpp's server reports by default. (KoboldCpp reports the probabilities
left after its sampler chain instead; docs/api.md says where the two differ.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id, log p(token), and up to N alternatives (id, log p), most likely first."""

    token_id: int
    logprob: float
    top: Tuple[Tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    """The log-probability of `token_id` and the `top_n` most likely tokens under log_softmax(logits [V])."""
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_n must be in [0, {MAX_TOP_LOGPROBS}], got {top_n}")
    logp = torch.log_softmax(logits.reshape(-1).float(), dim=-1)
    if top_n == 0:
        return TokenLogprob(int(token_id), float(logp[token_id]))
    values, ids = torch.topk(logp, min(top_n, logp.numel()))
    chosen, *top_values = torch.cat([logp[token_id].view(1), values]).tolist()  # one transfer for the values
    return TokenLogprob(int(token_id), float(chosen), tuple(zip((int(i) for i in ids.tolist()), top_values)))
