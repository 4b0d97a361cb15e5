"""The engine's per-token logprobs (engine/logprobs.TokenLogprob) in each dialect's shape: KoboldCpp's (the
`logprobs` of /api/v1/generate results and /api/extra/last_logprobs), OpenAI's legacy completions
(`choices[].logprobs` of /v1/completions) and OpenAI's chat completions (`choices[].logprobs.content`)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from kobold_backend.engine.logprobs import TokenLogprob
from kobold_backend.engine.tokenizer import complete_utf8_prefix

KOBOLDCPP_TOP_LOGPROBS = 5  # KoboldCpp's logprobs_max: alternatives per token with `logprobs: true`


def _token(tokenizer: Any, token_id: int) -> Tuple[str, List[int]]:
    """A token's text (an incomplete UTF-8 sequence shows as U+FFFD) and its bytes."""
    raw = bytes(tokenizer.token_bytes(token_id))
    return raw.decode("utf-8", errors="replace"), list(raw)


def _offsets(tokenizer: Any, items: Sequence[TokenLogprob]) -> List[int]:
    """Where each token starts in the generated text, in characters (a token that starts inside a character
    split over several tokens gets that character's offset)."""
    out: List[int] = []
    chars = 0
    pending = b""  # the start of a character whose other bytes come with the next tokens
    for item in items:
        out.append(chars)
        pending += bytes(tokenizer.token_bytes(item.token_id))
        whole = complete_utf8_prefix(pending)
        chars += len(pending[:whole].decode("utf-8", errors="replace"))
        pending = pending[whole:]
    return out


def _top(tokenizer: Any, item: TokenLogprob, with_ids: bool) -> List[Dict[str, Any]]:
    out = []
    for token_id, logprob in item.top:
        text, raw = _token(tokenizer, token_id)
        entry: Dict[str, Any] = {"token": text, "logprob": logprob, "bytes": raw}
        if with_ids:
            entry["token_id"] = token_id
        out.append(entry)
    return out


def kobold_logprobs(tokenizer: Any, items: Sequence[TokenLogprob]) -> Dict[str, Any]:
    """KoboldCpp's shape: `content` (OpenAI chat style, with token ids) plus the legacy parallel lists `tokens`,
    `token_ids`, `token_logprobs`, `top_logprobs` ({token: logprob} per token) and `text_offset`."""
    content, tokens, ids, logprobs, tops = [], [], [], [], []
    for item in items:
        text, raw = _token(tokenizer, item.token_id)
        top = _top(tokenizer, item, with_ids=True)
        content.append({"token": text, "token_id": item.token_id, "logprob": item.logprob, "bytes": raw,
                        "top_logprobs": top})
        tokens.append(text)
        ids.append(item.token_id)
        logprobs.append(item.logprob)
        tops.append({t["token"]: t["logprob"] for t in top})
    return {"content": content, "tokens": tokens, "token_ids": ids, "token_logprobs": logprobs,
            "top_logprobs": tops, "text_offset": _offsets(tokenizer, items)}


def completion_logprobs(tokenizer: Any, items: Sequence[TokenLogprob]) -> Dict[str, Any]:
    """OpenAI's legacy /v1/completions shape. As OpenAI documents, each `top_logprobs` entry holds the N most likely
    tokens and the chosen one, so it may have N + 1 keys (tokens with the same text share a key)."""
    tokens, logprobs, tops = [], [], []
    for item in items:
        text, _ = _token(tokenizer, item.token_id)
        tokens.append(text)
        logprobs.append(item.logprob)
        top = {_token(tokenizer, token_id)[0]: logprob for token_id, logprob in item.top}
        if item.top:
            top.setdefault(text, item.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": _offsets(tokenizer, items)}


def chat_logprobs(tokenizer: Any, items: Sequence[TokenLogprob]) -> Dict[str, Any]:
    """OpenAI's chat completions shape: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}."""
    content = []
    for item in items:
        text, raw = _token(tokenizer, item.token_id)
        content.append({"token": text, "logprob": item.logprob, "bytes": raw,
                        "top_logprobs": _top(tokenizer, item, with_ids=False)})
    return {"content": content, "refusal": None}
