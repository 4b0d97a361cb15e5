"""CUDA-graph decode: one captured graph per (rows, attention-length bucket) replays a whole forward.

Batch-1 decode is launch-bound long before it is bandwidth-bound; replaying a graph removes the
Python and launch overhead of several hundred kernels per token. Positions live in a device tensor
so one capture serves every position inside its bucket. One row is a decode step; k+1 rows are a speculative
verification (the drafted tokens scored in one forward that reads the weights once for all rows); a short prompt
chunk (a chat turn's new tokens) is padded to a multiple of 16 rows.
"""

from __future__ import annotations

import logging
from typing import Dict, Optional, Sequence, Tuple

import torch

from kobold_backend.engine.cache import KVCache
from kobold_backend.engine.model import Model

log = logging.getLogger(__name__)

MIN_BUCKET = 256
#: prompt chunks of up to this many tokens (a chat turn's new text) replay a graph too, padded to a multiple of
#: ROW_STEP rows so a conversation's varying turn lengths share a few captures
MAX_PREFILL_ROWS = 128
ROW_STEP = 16
_capture_streams: Dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every capture: the native kernels keep a scratch buffer per stream, so a
    fresh stream per capture would leave one more buffer behind each time a model is loaded."""
    if device not in _capture_streams:
        _capture_streams[device] = torch.cuda.Stream(device=device)
    return _capture_streams[device]


def graphs_supported(model: Model) -> bool:
    """Graphs need every layer, the embedding and the head on one CUDA device, and no recurrent layer (a linear
    attention state advances on the host's count of positions, and padded or rejected rows would corrupt it)."""
    if model.recurrent:
        return False
    devices = {layer.device for layer in model.layers} | {model.device, model.embed_tokens.device}
    return len(devices) == 1 and model.device.type == "cuda"


class GraphDecoder:
    """Decode steps for one cache, replayed from CUDA graphs captured on first use of each bucket."""

    def __init__(self, model: Model, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.pos = torch.zeros((1,), dtype=torch.long, device=model.device)
        self.ids: Dict[int, torch.Tensor] = {}  # rows -> the static [B, rows] input of that many tokens
        self.graphs: Dict[Tuple[int, int], Tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def bucket(self, length: int) -> int:
        size = MIN_BUCKET
        while size < length:
            size *= 2
        return min(size, self.cache.max_seq_len)

    def step(self, token: int) -> torch.Tensor:
        """Feed one token at cache.seq_len; returns float32 logits [V] (a view of a static buffer)."""
        return self.rows([token])[0]

    def prefill(self, tokens: Sequence[int]) -> Optional[torch.Tensor]:
        """Feed a short prompt chunk (2..MAX_PREFILL_ROWS tokens) in one replay; float32 logits [V] after its last
        token, or None when the padded rows do not fit in the cache (then the caller runs the chunk eagerly).
        The padding rows repeat the last token at the positions after the chunk: they write cache entries past
        `seq_len`, which nothing reads before a later token overwrites them."""
        t = len(tokens)
        padded = -(-t // ROW_STEP) * ROW_STEP
        pos = self.cache.seq_len
        if not 1 < t <= MAX_PREFILL_ROWS or pos + padded > self.cache.max_seq_len:
            return None
        logits = self.rows(list(tokens) + [tokens[-1]] * (padded - t))
        self.cache.seq_len = pos + t
        return logits[t - 1]

    def rows(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feed tokens at cache.seq_len.. in one forward; float32 logits [T, V], row i after tokens[i] (a view of
        a static buffer, overwritten by the next replay)."""
        t = len(tokens)
        pos = self.cache.reserve(t)
        ids = self.ids.get(t)
        if ids is None:
            ids = self.ids[t] = torch.zeros((self.cache.batch_size, t), dtype=torch.long, device=self.model.device)
        if t == 1:
            ids.fill_(tokens[0])
        else:
            ids.copy_(torch.tensor(tokens, dtype=torch.long).expand(self.cache.batch_size, t))
        self.pos.fill_(pos)
        length = self.bucket(pos + t)
        entry = self.graphs.get((t, length))
        if entry is None:
            entry = self._capture(ids, length)
        entry[0].replay()
        self.cache.seq_len = pos + t
        return entry[1][0]

    def _capture(self, ids: torch.Tensor, length: int) -> Tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        t = ids.shape[1]
        log.debug("capturing a %d-row decode graph for attention length %d", t, length)
        stream = capture_stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up allocations and lazy initialisation outside the capture
                self.model.decode_step(ids, self.pos, self.cache, length)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.decode_step(ids, self.pos, self.cache, length)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(t, length)] = (graph, logits)
        return graph, logits
