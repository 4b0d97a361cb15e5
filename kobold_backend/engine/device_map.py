"""Layer split across GPUs and the CPU: plans per-layer placement from safetensors headers (counts or memory
budgets, exllama's gpu_split) and refuses a plan that cannot fit before any weight is read.

Placement only: the command-line flags live in kobold_backend/cli/split.py, United's slider ids in
kobold_backend/engine/load_options.py, and the offload benchmark in kobold_backend/bench/split.py.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from kobold_backend.engine.cache import MAX_SNAPSHOTS, cache_bytes_per_token
from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.loader import DEFAULT_MAX_SEQ_LEN, resolve_dtype
from kobold_backend.engine.weights import WeightReader
from kobold_backend.errors import ModelFormatError, PlanError

log = logging.getLogger(__name__)

GIB = 1 << 30  # budgets are in GB of 2**30 bytes, as exllama's gpu_split
DEFAULT_GPU_RESERVE_GIB = 0.5
DEFAULT_CPU_RESERVE_GIB = 1.0
PREFILL_CHUNK = 2048  # the most tokens the generator feeds through the model at once
GPU_LIBRARY_BYTES = 128 << 20  # cuBLAS/cuBLASLt workspaces and kernel scratch, per GPU in use
Shapes = Dict[str, Tuple[int, ...]]


# ---------------------------------------------------------------------------------------------------------------
# Tensor shapes: read from the checkpoint's headers, or derived from a config (no weights needed).


def checkpoint_shapes(folder: Union[str, Path]) -> Shapes:
    """Every tensor's shape from the safetensors headers; no tensor data is read."""
    with WeightReader(folder) as reader:
        reader.rename(ModelConfig.from_dir(folder).description.stored_names(reader.names()))
        return {name: reader.shape(name) for name in reader.names()}


def config_shapes(config: ModelConfig) -> Shapes:
    """The tensor shapes a checkpoint of this config holds, as its architecture lays them out: GPTQ linears
    (qweight/qzeros/scales/g_idx) when `config.quant` is set, dense otherwise; a dense lm_head unless the
    embeddings are tied; the biases the architecture declares."""
    h = config.hidden_size
    shapes: Shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    shapes.update(config.description.model_tensors(config))
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        layout = config.description.layout(config, i)
        for ckpt, size in layout.norms.values():
            shapes[f"{p}.{ckpt}.weight"] = size if isinstance(size, tuple) else (size,)
        shapes.update({f"{p}.{name}": shape for name, shape in layout.tensors.items()})
        shapes.update({f"{p}.{name}": shape for name, shape in layout.extras.values()})
        for name, lin in {**layout.linears, **layout.mlp_linears}.items():
            k, n = lin.in_features, lin.out_features
            if name in layout.biased:
                shapes[f"{p}.{lin.prefix}.bias"] = (n,)
            if config.quant is None or not lin.quantized:
                shapes[f"{p}.{lin.prefix}.weight"] = (n, k)
                continue
            gs = config.quant.group_size
            groups = -(-k // gs) if gs > 0 else 1
            shapes[f"{p}.{lin.prefix}.qweight"] = (k // 8, n)
            shapes[f"{p}.{lin.prefix}.qzeros"] = (groups, n // 8)
            shapes[f"{p}.{lin.prefix}.scales"] = (groups, n)
            shapes[f"{p}.{lin.prefix}.g_idx"] = (k,)
    return shapes


def _numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape))


def _elem(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


class Sizes:
    """Bytes each part of the model takes once loaded, as the loader stores it on a device of a given dtype.

    The in-memory layout is counted, not the file: dense weights and GPTQ scales in the compute dtype (float32
    on the CPU), qweight int32 (4 bits per weight), GPTQ zeros unpacked to [groups, N] in the compute dtype,
    an int64 row permutation per act-order linear, g_idx dropped (a down_proj's moves to its layer as `mlp_perm`
    when engine/mlp_fold.py folds it into gate/up: the same bytes).
    """

    def __init__(self, config: ModelConfig, shapes: Shapes, max_seq_len: int, batch_size: int = 1,
                 prefill_chunk: int = PREFILL_CHUNK, cache_dtype: str = "fp16") -> None:
        self.config = config
        self.cache_dtype = cache_dtype
        self.shapes = shapes
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        self.chunk = min(prefill_chunk, max_seq_len)

    def _shape(self, name: str) -> Tuple[int, ...]:
        try:
            return self.shapes[name]
        except KeyError:
            raise ModelFormatError(f"Tensor {name} is missing from the checkpoint.") from None

    def _gptq(self, prefix: str) -> bool:
        return self.config.quant is not None and f"{prefix}.qweight" in self.shapes

    def linear(self, prefix: str, elem: int, with_bias: bool = True) -> int:
        bias = self.shapes.get(f"{prefix}.bias") if with_bias else None
        extra = _numel(bias) * elem if bias is not None else 0
        if f"{prefix}.q_weight" in self.shapes:
            return self._exl2(prefix) + extra
        if not self._gptq(prefix):
            return _numel(self._shape(f"{prefix}.weight")) * elem + extra
        k8, n = self._shape(f"{prefix}.qweight")
        groups = self._shape(f"{prefix}.qzeros")[0]
        total = k8 * n * 4 + 2 * groups * n * elem  # qweight, scales, unpacked zeros
        assert self.config.quant is not None
        if self.config.quant.desc_act and f"{prefix}.g_idx" in self.shapes:
            # int64 row permutation, one per in_features (qweight packs 8 or 4 rows per word: count g_idx)
            total += _numel(self._shape(f"{prefix}.g_idx")) * 8
        return total + extra

    def _exl2(self, prefix: str) -> int:
        """An EXL2 linear as engine/exl2.py keeps it: its tensors as stored, an int64 row permutation and the
        chunk tables (12 bytes per 32 rows)."""
        k = self._shape(f"{prefix}.q_invperm")[0]
        stored = {"q_weight": 4, "q_scale": 4, "q_scale_max": 2, "q_groups": 2}
        return sum(_numel(self._shape(f"{prefix}.{t}")) * size for t, size in stored.items()) + 8 * k + 12 * (k // 32)

    def layer(self, index: int, elem: int) -> int:
        """Every tensor under `model.layers.N.`, whatever the architecture names it (norms, biases, dense or GPTQ
        projections, experts); a GPTQ linear counts as `linear` lays it out in memory."""
        p = f"model.layers.{index}."
        # what the description lists beyond the suffixes below (Gemma 4's layer scalar, router scales)
        listed = set(self.config.description.layout(self.config, index).tensors) if self.config.arch is not None \
            else set()
        total = 0
        for name, shape in self.shapes.items():
            if not name.startswith(p):
                continue
            if name.endswith(".qweight"):
                total += self.linear(name[: -len(".qweight")], elem, with_bias=False)
            elif name.endswith(".q_weight"):
                total += self._exl2(name[: -len(".q_weight")])
            elif name.endswith("_blocks"):  # MXFP4 (gpt-oss's experts), dequantized at load: 32 values per 16 bytes
                total += _numel(shape) * 2 * elem
            # `_proj`: gpt-oss's stacked experts; `_bias`: GLM-4.5's and DeepSeek-V3's e_score_correction_bias and
            # Qwen3.5's dt_bias; `.A_log`: Qwen3.5's decay
            elif name.endswith((".weight", ".bias", "_bias", "_proj", ".sinks", ".A_log")) or name[len(p):] in listed:
                total += _numel(shape) * elem
        return total

    def cache(self, elem: int, index: int = 0) -> int:
        """K and V of layer `index` for max_seq_len positions, in the layer's dtype (`elem` bytes) or quantized;
        none for a layer that reads an earlier layer's cache (Gemma 4 / 3n KV sharing); for a layer with a
        fixed-size state instead (linear attention), that state and its snapshots."""
        c = self.config
        if c.features is not None and c.layer_kv_source(index) is not None:
            return 0
        state = c.description.state_bytes(c, index, elem) if c.arch is not None else None
        if state is not None:
            return self.batch_size * state * (1 + MAX_SNAPSHOTS)
        heads, key, value = c.features.cache_shape if c.features is not None else (0, 0, 0)
        if heads:
            per_token = heads * (key + value) * elem
        else:
            heads, dim = (c.layer_kv_heads(index), c.layer_head_dim(index)) if c.features is not None else \
                (c.num_kv_heads, c.head_dim)
            per_token = cache_bytes_per_token(self.cache_dtype, heads, dim, elem)
        return self.batch_size * self.max_seq_len * per_token

    def rope(self, elem: int) -> int:
        """The cos and sin tables, once per device holding layers and per distinct RoPE (Gemma 3 has two)."""
        tables = len(set(self.config.features.ropes)) if self.config.features is not None else 1
        return 2 * self.max_seq_len * self.config.head_dim * elem * tables

    def embed(self, elem: int) -> int:
        """The embedding and the model-level tensors loaded beside it (per-layer embeddings, AltUp projections)."""
        extra = self.config.description.model_tensors(self.config) if self.config.arch is not None else {}
        return sum(_numel(self._shape(name)) for name in ["model.embed_tokens.weight", *extra]) * elem

    def tied(self) -> bool:
        return self.config.tie_word_embeddings or not any(
            f"lm_head.{t}" in self.shapes for t in ("weight", "qweight", "q_weight"))

    def head(self, elem: int, shares_embed: bool) -> int:
        """Final norm and lm_head; a tied head costs nothing when it can reuse the embedding tensor."""
        norm = _numel(self._shape("model.norm.weight")) * elem
        if self.tied():
            return norm + (0 if shares_embed else self.embed(elem))
        return norm + self.linear("lm_head", elem)

    def working(self, elem: int) -> int:
        """Temporaries of one prefill chunk through a layer: hidden state, residual, q/k/v/attention output,
        gate/up/silu, GQA-expanded K/V, and the largest GPTQ matrix dequantized (int32 unpack + compute copy)."""
        c, t, b = self.config, self.chunk, self.batch_size
        qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        acts = b * t * (4 * c.hidden_size + 3 * qd + 2 * kvd + 3 * c.intermediate_size) * elem
        gqa = 2 * b * c.num_heads * self.max_seq_len * c.head_dim * elem if c.num_heads != c.num_kv_heads else 0
        if self.cache_dtype != "fp16":  # a chunk dequantizes the attended K and V (float32, then the dtype)
            gqa += 2 * b * c.num_kv_heads * self.max_seq_len * c.head_dim * (8 + elem)
        dq = 0
        for name, shape in self.shapes.items():
            if name.startswith("model.layers.0.") and name.endswith(".qweight") and self.config.quant is not None:
                k8, n = shape
                dq = max(dq, k8 * 8 * n * (4 + elem))
            if name.startswith("model.layers.0.") and name.endswith(".q_weight"):
                dq = max(dq, self._shape(name[: -len("q_weight")] + "q_invperm")[0] * shape[1] * 2)  # fp16 [K, N]
        return acts + gqa + dq

    def head_working(self, elem: int) -> int:
        """The last chunk's normed hidden state and the float32 logits of its last row."""
        return self.batch_size * (self.chunk * self.config.hidden_size * elem + self.config.vocab_size * 8)


# ---------------------------------------------------------------------------------------------------------------
# The plan.


def normalize_device(device: Union[str, int, torch.device]) -> str:
    """'cuda' -> 'cuda:0', 3 or '3' -> 'cuda:3', 'cpu' stays; anything else is a PlanError."""
    if isinstance(device, int) or (isinstance(device, str) and device.strip().isdigit()):
        return f"cuda:{int(device)}"
    try:
        dev = torch.device(str(device).strip().lower())
    except (RuntimeError, ValueError):
        raise PlanError(f"{device!r} is not a device (use cpu, cuda, cuda:N or a GPU number).") from None
    if dev.type == "cuda":
        return f"cuda:{dev.index or 0}"
    if dev.type == "cpu":
        return "cpu" if dev.index is None else f"cpu:{dev.index}"
    raise PlanError(f"device {device!r} is not supported for a layer split (use cpu or cuda:N).")


def _pool(device: str) -> str:
    """Memory pool of a device: each GPU its own, every cpu placement shares system RAM ('cpu')."""
    return "cpu" if device.startswith("cpu") else device


def _is_gpu(device: str) -> bool:
    return device.startswith("cuda")


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _ranges(indices: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'; '-' for none."""
    runs: List[List[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "-"


def as_layer_count(value: Any, what: str) -> int:
    """A whole number of layers >= 0 from an int, an integral float or a digit string (PlanError otherwise)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PlanError(f"the layer count for {what} is {value!r}, not a whole number") from None
    if isinstance(value, bool) or not number.is_integer() or number < 0:
        raise PlanError(f"the layer count for {what} is {value!r}; counts must be whole numbers >= 0")
    return int(number)


@dataclass
class DeviceUsage:
    """What one device holds under a plan, in bytes; `budget` None means unchecked."""

    device: str
    layers: List[int] = field(default_factory=list)
    weight_bytes: int = 0
    cache_bytes: int = 0
    buffer_bytes: int = 0
    budget: Optional[int] = None
    holds: List[str] = field(default_factory=list)  # "embeddings", "norm+lm_head"

    @property
    def used_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes + self.buffer_bytes

    @property
    def free_bytes(self) -> Optional[int]:
        return None if self.budget is None else self.budget - self.used_bytes


@dataclass
class DeviceMap:
    """A placement for load_model: `layer_devices` (one per layer), the head's device and the embeddings'."""

    layer_devices: List[str]
    head_device: str
    embed_device: str
    max_seq_len: int
    gpu_dtype: torch.dtype
    usage: List[DeviceUsage]
    name: str = "model"
    cache_dtype: str = "fp16"

    @property
    def uniform(self) -> bool:
        """True when every layer is on the head's device (load_model needs no layer_devices then)."""
        return all(d == self.head_device for d in self.layer_devices)

    def layers_on(self, device: str) -> int:
        return sum(1 for d in self.layer_devices if d == device)

    def load_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of kobold_backend.engine.loader.load_model that realise this plan."""
        return {"device": self.head_device, "layer_devices": None if self.uniform else list(self.layer_devices),
                "embed_on_cpu": self.embed_device == "cpu" and self.head_device != "cpu",
                "max_seq_len": self.max_seq_len, "cache_dtype": self.cache_dtype}

    def describe(self) -> str:
        """A printable table: per device the layer range, weight, cache and buffer GiB, budget and free GiB."""
        n = len(self.layer_devices)
        dt = str(self.gpu_dtype).replace("torch.", "")
        lines = [f"layer split of {self.name}: {n} layers, {self.max_seq_len}-token {self.cache_dtype} cache, "
                 f"{dt} on GPUs, float32 on the CPU"]
        header = ("device", "layers", "weights", "cache", "buffers", "total", "budget", "free")
        rows = [header]
        for u in self.usage:
            budget = "-" if u.budget is None else _gib(u.budget)
            free = "-" if u.free_bytes is None else _gib(u.free_bytes)
            label = _ranges(u.layers) + (f" +{'+'.join(u.holds)}" if u.holds else "")
            rows.append((u.device, label, _gib(u.weight_bytes), _gib(u.cache_bytes), _gib(u.buffer_bytes),
                         _gib(u.used_bytes), budget, free))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for r in rows:
            lines.append("  " + "  ".join(r[i].ljust(widths[i]) if i < 2 else r[i].rjust(widths[i])
                                          for i in range(len(header))))
        return "\n".join(lines)


def _source(source: Union[str, Path, ModelConfig], shapes: Optional[Shapes]) -> Tuple[ModelConfig, Shapes, str]:
    if isinstance(source, ModelConfig):
        return source, shapes if shapes is not None else config_shapes(source), "model"
    folder = Path(source)
    config = ModelConfig.from_dir(folder)
    return config, shapes if shapes is not None else checkpoint_shapes(folder), folder.name


def _counts_order(layer_counts: Mapping[Any, int], num_layers: int) -> List[Tuple[str, int]]:
    """Validated (device, count) pairs, CPU placements first, then GPUs in the order given."""
    pairs: List[Tuple[str, int]] = []
    for key, count in layer_counts.items():
        dev = normalize_device(key)
        value = as_layer_count(count, dev)
        if any(d == dev for d, _ in pairs):
            raise PlanError(f"{dev} is given twice in the layer counts")
        pairs.append((dev, value))
    total = sum(c for _, c in pairs)
    if total != num_layers:
        listed = " + ".join(f"{d} {c}" for d, c in pairs) or "nothing"
        raise PlanError(f"the layer counts add up to {total} ({listed}) but the model has {num_layers} layers")
    return [p for p in pairs if not _is_gpu(p[0])] + [p for p in pairs if _is_gpu(p[0])]


def plan_device_map(
    source: Union[str, Path, ModelConfig],
    budgets: Optional[Mapping[Any, float]] = None,
    max_seq_len: Optional[int] = None,
    *,
    layer_counts: Optional[Mapping[Any, int]] = None,
    cpu_layers: Union[int, str, None] = None,
    embed_on_cpu: bool = False,
    head_device: Optional[str] = None,
    dtype: Optional[str] = None,
    batch_size: int = 1,
    shapes: Optional[Shapes] = None,
    cache_dtype: str = "fp16",
) -> DeviceMap:
    """Place every decoder layer on a device, or raise PlanError before anything is loaded.

    `source` is a model folder (tensor shapes from its safetensors headers) or a ModelConfig (shapes derived
    from it: `config.quant` set means a GPTQ checkpoint). `budgets` maps devices ("cuda:0", 1, "cpu") to the
    GB (2**30 bytes) each may use for weights, KV cache and working buffers; a device without a budget is not
    checked. Either `layer_counts` fixes how many layers each device runs (United's per-GPU sliders), or the
    GPUs in `budgets` are filled in order with as many layers as fit; `cpu_layers` N puts N layers on the CPU
    first, and "auto" puts there whatever does not fit on the GPUs (without it, a model that does not fit is
    an error). CPU layers come first (the hidden state then crosses to the GPU once when the embeddings are in
    RAM). Norm and lm_head go on `head_device`, by default the first GPU given layers (or a budget), else the
    CPU; the embeddings go with them unless `embed_on_cpu`.
    """
    config, shapes, name = _source(source, shapes)
    n_layers = config.num_layers
    seq = max_seq_len or min(config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
    gpu_dtype = resolve_dtype(dtype, torch.device("cuda"), config)
    sizes = Sizes(config, shapes, seq, batch_size, cache_dtype=cache_dtype)
    limits: Dict[str, int] = {}
    for key, gb in (budgets or {}).items():
        if gb is None or not gb >= 0:
            raise PlanError(f"the memory budget for {normalize_device(key)} is {gb!r}; it must be >= 0 GB")
        limits[_pool(normalize_device(key))] = int(gb * GIB)

    if layer_counts is not None:
        if cpu_layers is not None:
            raise PlanError("give either per-device layer counts or a number of CPU layers, not both")
        order = _counts_order(layer_counts, n_layers)
        head = head_device or next((d for d, c in order if _is_gpu(d) and c > 0), "cpu")
    else:
        if budgets is None:
            raise PlanError("a layer split needs per-device layer counts or memory budgets")
        gpus = [d for d in limits if _is_gpu(d)]
        head = head_device or next((d for d in gpus if limits[d] > 0), None) or next(iter(gpus), "cpu")
        order = _fill(sizes, limits, gpus, normalize_device(head), cpu_layers, embed_on_cpu, gpu_dtype, n_layers)
    head = normalize_device(head)
    layer_devices: List[str] = []
    for dev, count in order:
        layer_devices += [dev] * count
    dm = _account(sizes, layer_devices, head, embed_on_cpu, gpu_dtype, limits, name, seq)
    _check(dm, sizes)
    return dm


def _elem_for(device: str, gpu_dtype: torch.dtype) -> int:
    return _elem(gpu_dtype) if _is_gpu(device) else 4


def _head_bytes(sizes: Sizes, head: str, embed_dev: str, gpu_dtype: torch.dtype) -> Tuple[int, int]:
    """(weights, buffers) the head device carries beyond its layers, embeddings included when they are there."""
    e = _elem_for(head, gpu_dtype)
    weights = sizes.head(e, shares_embed=embed_dev == head)
    if embed_dev == head:
        weights += sizes.embed(e)
    return weights, sizes.head_working(e)


def _fill(sizes: Sizes, limits: Dict[str, int], gpus: List[str], head: str, cpu_layers: Union[int, str, None],
          embed_on_cpu: bool, gpu_dtype: torch.dtype, n_layers: int) -> List[Tuple[str, int]]:
    """Greedy fill of the GPUs in order (exllama's auto_map), after the head's share of its device."""
    if isinstance(cpu_layers, str) and cpu_layers != "auto":
        raise PlanError(f"cpu_layers is {cpu_layers!r}; use a number of layers or 'auto'")
    fixed_cpu = cpu_layers if isinstance(cpu_layers, int) else 0
    if not 0 <= fixed_cpu <= n_layers:
        raise PlanError(f"cpu_layers is {fixed_cpu} but the model has {n_layers} layers")
    if not gpus and cpu_layers is None:
        raise PlanError("no GPU budget was given; give GPU budgets, or cpu_layers='auto' to run on the CPU")
    e = _elem(gpu_dtype)
    per_layer = max(sizes.layer(i, e) + sizes.cache(e, i) for i in range(n_layers))
    first_layer_extra = sizes.working(e) + sizes.rope(e)
    embed_dev = "cpu" if embed_on_cpu or head == "cpu" else head
    used = {d: 0 for d in gpus}
    if head in used:
        w, b = _head_bytes(sizes, head, embed_dev, gpu_dtype)
        used[head] = w + b + GPU_LIBRARY_BYTES
        if used[head] > limits[head]:
            raise PlanError(
                f"{head} cannot hold even the embeddings, norm and lm_head ({_gib(used[head])}) within its "
                f"{_gib(limits[head])} budget: short by {_gib(used[head] - limits[head])}"
                + ("" if embed_on_cpu else "; keep the embeddings in system RAM (--embed-on-cpu) or raise the budget")
            )
    remaining = n_layers - fixed_cpu
    counts: List[Tuple[str, int]] = []
    last, last_count = None, 0
    for dev in gpus:
        count = 0
        while remaining > 0:
            extra = per_layer + (first_layer_extra + (0 if dev == head else GPU_LIBRARY_BYTES) if count == 0 else 0)
            if used[dev] + extra > limits[dev]:
                break
            used[dev] += extra
            count += 1
            remaining -= 1
        counts.append((dev, count))
        last, last_count = dev, count
    spill = 0
    if remaining > 0:
        if cpu_layers != "auto":
            if last is None:
                raise PlanError("no GPU budget was given for the layers that are not on the CPU")
            need = used[last] + remaining * per_layer
            if last_count == 0:
                need += first_layer_extra + (0 if last == head else GPU_LIBRARY_BYTES)
            raise PlanError(
                f"the model does not fit: {remaining} of {n_layers} layers are left after filling "
                f"{', '.join(f'{d} ({_gib(limits[d])})' for d in gpus)}; {last} would need {_gib(need)}, "
                f"short by {_gib(need - limits[last])} (each layer takes {_gib(per_layer)} with its "
                f"{sizes.max_seq_len}-token cache). Put layers on the CPU (--cpu-layers auto), lower the "
                "context, or raise the budgets."
            )
        spill = remaining
    cpu = fixed_cpu + spill
    return ([("cpu", cpu)] if cpu else []) + counts


def _account(sizes: Sizes, layer_devices: List[str], head: str, embed_on_cpu: bool, gpu_dtype: torch.dtype,
             limits: Dict[str, int], name: str, seq: int) -> DeviceMap:
    embed_dev = "cpu" if embed_on_cpu or head == "cpu" else head
    devices = list(dict.fromkeys(layer_devices + [head, embed_dev]))
    devices = [d for d in devices if not _is_gpu(d)] + [d for d in devices if _is_gpu(d)]
    usage = {d: DeviceUsage(d) for d in devices}
    for i, dev in enumerate(layer_devices):
        e = _elem_for(dev, gpu_dtype)
        u = usage[dev]
        if not u.layers:
            u.buffer_bytes += sizes.working(e) + sizes.rope(e)
        u.layers.append(i)
        u.weight_bytes += sizes.layer(i, e)
        u.cache_bytes += sizes.cache(e, i)
    w, b = _head_bytes(sizes, head, embed_dev, gpu_dtype)
    usage[head].weight_bytes += w
    usage[head].buffer_bytes += b
    usage[head].holds.append("head")
    if embed_dev != head:
        usage[embed_dev].weight_bytes += sizes.embed(4)
    usage[embed_dev].holds.insert(0, "embed")
    for d, u in usage.items():
        if _is_gpu(d):
            u.buffer_bytes += GPU_LIBRARY_BYTES
    for d, u in usage.items():
        if _pool(d) == d:
            u.budget = limits.get(d)
    return DeviceMap(layer_devices=layer_devices, head_device=head, embed_device=embed_dev, max_seq_len=seq,
                     gpu_dtype=gpu_dtype, usage=list(usage.values()), name=name, cache_dtype=sizes.cache_dtype)


def _check(dm: DeviceMap, sizes: Sizes) -> None:
    """Every memory pool with a budget must hold what the plan puts there."""
    pools: Dict[str, int] = {}
    for u in dm.usage:
        pools[_pool(u.device)] = pools.get(_pool(u.device), 0) + u.used_bytes
    budgets = {_pool(u.device): u.budget for u in dm.usage if u.budget is not None}
    for pool, used in pools.items():
        budget = budgets.get(pool)
        if budget is None or used <= budget:
            continue
        parts = [u for u in dm.usage if _pool(u.device) == pool]
        layers = sum(len(u.layers) for u in parts)
        detail = (f"{layers} layers: {_gib(sum(u.weight_bytes for u in parts))} weights, "
                  f"{_gib(sum(u.cache_bytes for u in parts))} cache at {sizes.max_seq_len} tokens, "
                  f"{_gib(sum(u.buffer_bytes for u in parts))} buffers")
        raise PlanError(f"{pool} needs {_gib(used)} ({detail}) but its budget is {_gib(budget)}: "
                        f"short by {_gib(used - budget)}. Move layers to another device or lower the context.")


# ---------------------------------------------------------------------------------------------------------------
# Budgets of this machine, and the split asked for by load options.


@dataclass
class HardwareProbe:
    """Free memory of this machine: bytes free per visible GPU, and available system RAM (None if unknown)."""

    gpu_free: List[int]
    cpu_available: Optional[int]

    @classmethod
    def detect(cls) -> HardwareProbe:
        gpus: List[int] = []
        if torch.cuda.is_available():
            gpus = [int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())]
        return cls(gpu_free=gpus, cpu_available=_available_ram())


def _available_ram() -> Optional[int]:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def auto_budgets(probe: Optional[HardwareProbe] = None, reserve_gib: float = DEFAULT_GPU_RESERVE_GIB,
                 cpu_reserve_gib: float = DEFAULT_CPU_RESERVE_GIB) -> Dict[str, float]:
    """GB budgets of every visible GPU (free memory minus `reserve_gib`) and of the CPU (available RAM minus
    `cpu_reserve_gib`, when known)."""
    probe = probe or HardwareProbe.detect()
    out = {f"cuda:{i}": max(0.0, free / GIB - reserve_gib) for i, free in enumerate(probe.gpu_free)}
    if probe.cpu_available is not None:
        out["cpu"] = max(0.0, probe.cpu_available / GIB - cpu_reserve_gib)
    return out


def plan_split(
    folder: Union[str, Path],
    max_seq_len: Optional[int] = None,
    *,
    layer_counts: Optional[Mapping[str, int]] = None,
    gpu_split: Union[str, Mapping[str, float], None] = None,
    cpu_layers: Union[int, str, None] = None,
    device: str = "auto",
    embed_on_cpu: bool = False,
    dtype: Optional[str] = None,
    probe: Optional[HardwareProbe] = None,
    cache_dtype: str = "fp16",
) -> Optional[DeviceMap]:
    """The plan asked for by load options, checked against this machine's free memory; None when nothing asks
    for a split. Either `layer_counts` (device -> layers, e.g. United's per-GPU sliders), or `gpu_split` ("auto"
    or GB per GPU) and/or `cpu_layers` (N or "auto") with `device` naming the main GPU. Budgets come from
    `probe` (default: this machine) for every device not given one. The plan is logged; PlanError names the
    device and the shortfall when it cannot fit. `cache_dtype` (engine/cache.py) sizes the KV cache."""
    plan = _plan_split(folder, max_seq_len, layer_counts, gpu_split, cpu_layers, device.strip().lower(),
                       embed_on_cpu, dtype or None, probe, cache_dtype)
    if plan is not None:
        log.info("%s", plan.describe())
    return plan


def _plan_split(
    folder: Union[str, Path], max_seq_len: Optional[int], counts: Optional[Mapping[str, int]],
    gpu_split: Union[str, Mapping[str, float], None], cpu_layers: Union[int, str, None], device: str,
    embed_on_cpu: bool, dtype: Optional[str], probe: Optional[HardwareProbe], cache_dtype: str = "fp16",
) -> Optional[DeviceMap]:
    if counts is None and gpu_split is None and cpu_layers is None:
        return None
    probe = probe or HardwareProbe.detect()
    machine = auto_budgets(probe)
    n_gpus = len(probe.gpu_free)
    if counts is not None:
        pools = {_pool(normalize_device(d)) for d, c in counts.items() if c > 0}
        budgets = {d: gb for d, gb in machine.items() if d in pools}
        _require_gpus([normalize_device(d) for d, c in counts.items() if c > 0 and _is_gpu(normalize_device(d))],
                      n_gpus)
        return plan_device_map(folder, budgets, max_seq_len, layer_counts=counts, embed_on_cpu=embed_on_cpu,
                               dtype=dtype, cache_dtype=cache_dtype)
    if device == "cpu":
        if gpu_split is not None:
            raise PlanError("--gpu-split was given with --device cpu; drop one of them")
        return None
    head = None if device in ("auto", "cuda") else normalize_device(device)
    if gpu_split is None:
        main = head or ("cuda:0" if n_gpus else "cpu")
        if main == "cpu":
            return None  # no GPU: every layer is on the CPU already
        _require_gpus([main], n_gpus)
        budgets = {k: v for k, v in machine.items() if k in (main, "cpu")}
        if cpu_layers == "auto":
            return plan_device_map(folder, budgets, max_seq_len, cpu_layers="auto", embed_on_cpu=embed_on_cpu,
                                   head_device=main, dtype=dtype, cache_dtype=cache_dtype)
        assert isinstance(cpu_layers, int)
        config = ModelConfig.from_dir(folder)
        n_cpu = cpu_layers
        if n_cpu > config.num_layers:
            raise PlanError(f"--cpu-layers {n_cpu} but the model has {config.num_layers} layers")
        layer_counts = {"cpu": n_cpu, main: config.num_layers - n_cpu}
        return plan_device_map(folder, budgets, max_seq_len, layer_counts=layer_counts, embed_on_cpu=embed_on_cpu,
                               head_device=main, dtype=dtype, cache_dtype=cache_dtype)
    if gpu_split == "auto":
        if not n_gpus:
            raise PlanError("--gpu-split auto was given but torch sees no CUDA GPU")
        budgets = dict(machine)
    else:
        assert not isinstance(gpu_split, str)
        _require_gpus([normalize_device(d) for d in gpu_split], n_gpus)
        budgets = {normalize_device(d): gb for d, gb in gpu_split.items()}
        if "cpu" in machine:
            budgets["cpu"] = machine["cpu"]
    if head is not None and head not in budgets:
        raise PlanError(f"--device {device} is not one of the GPUs in --gpu-split ({', '.join(sorted(budgets))})")
    return plan_device_map(folder, budgets, max_seq_len, cpu_layers=cpu_layers, embed_on_cpu=embed_on_cpu,
                           head_device=head, dtype=dtype, cache_dtype=cache_dtype)


def _require_gpus(devices: Sequence[str], n_gpus: int) -> None:
    for dev in devices:
        index = int(dev.split(":")[1])
        if index >= n_gpus:
            seen = f"{n_gpus} GPU{'s' if n_gpus != 1 else ''}" if n_gpus else "no CUDA GPU"
            raise PlanError(f"the split places layers on {dev} but torch sees {seen}")
