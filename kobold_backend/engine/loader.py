"""load_model(folder) -> LoadedModel: reads config, tokenizer and weights (tensor by tensor) onto devices."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from kobold_backend.engine.architectures import RopeSpec
from kobold_backend.engine.awq import load_awq_linear
from kobold_backend.engine.cache import MAX_SNAPSHOTS, cache_bytes_per_token, cache_schemes, check_cache_dtype
from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.drafters import check_draft_tokenizer
from kobold_backend.engine.exl2 import is_exl2_linear, load_exl2_linear, with_exl2_detected
from kobold_backend.engine.gguf.checkpoint import open_gguf
from kobold_backend.engine.gguf.weights import GGUFWeights
from kobold_backend.engine.gptq import load_gptq_linear
from kobold_backend.engine.mlp_fold import fold_down_permutation
from kobold_backend.engine.model import Layer, Model, Weight
from kobold_backend.engine.model_files import is_gguf_file
from kobold_backend.engine.rope import cos_sin_tables
from kobold_backend.engine.stored_format import stored_format
from kobold_backend.engine.tokenizer import Tokenizer, load_tokenizer
from kobold_backend.engine.weight_format import WeightFormat
from kobold_backend.engine.weights import WeightReader
from kobold_backend.errors import ModelFormatError
from kobold_backend.ops.exl2_weight import EXL2Weight
from kobold_backend.ops.ggml import GGMLWeight
from kobold_backend.ops.gptq_weight import GPTQWeight

if TYPE_CHECKING:
    from kobold_backend.engine.speculative import SpeculationConfig

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]
DEFAULT_MAX_SEQ_LEN = 8192

_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


@dataclass
class LoadedModel:
    """A model with its tokenizer; `unload()` frees every tensor it holds."""

    model: Model
    tokenizer: Tokenizer  # None only when loaded with with_tokenizer=False (benchmarks)
    config: ModelConfig
    path: Path
    name: str
    weight_format: Optional[WeightFormat] = None
    speculation: Optional[SpeculationConfig] = None  # how the Generator speculates (engine/speculative.py)
    draft: Optional[LoadedModel] = None  # the draft model of speculative decoding, unloaded with this one

    def unload(self) -> None:
        if self.draft is not None:
            self.draft.unload()
            self.draft = None
        devices = {layer.device for layer in self.model.layers} | {self.model.device}
        self.model.layers.clear()
        self.model.embed_tokens = self.model.norm = self.model.lm_head = None  # type: ignore[assignment]
        self.model.cos.clear()
        self.model.sin.clear()
        gc.collect()
        if any(d.type == "cuda" for d in devices) and torch.cuda.is_available():
            torch.cuda.empty_cache()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"Device {device} was asked for but this torch build sees no CUDA GPU.")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())  # tensors report cuda:N; compare like with like
    return dev


def resolve_dtype(dtype: Optional[str], device: torch.device, config: ModelConfig) -> torch.dtype:
    if dtype is not None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(sorted(_DTYPES))}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    if config.torch_dtype == "bfloat16" and not config.is_gptq:
        return torch.bfloat16
    return torch.float16


@dataclass
class Checkpoint:
    """A model's files opened and checked without reading a weight (open_checkpoint): its config, tokenizer and
    weight reader (memory-mapped shards or GGUF file). load_model(checkpoint=...) takes it over; close() releases a
    checkpoint that is not loaded after all."""

    path: Path
    config: ModelConfig
    tokenizer: Optional[Tokenizer]
    reader: Union[WeightReader, GGUFWeights]

    def close(self) -> None:
        self.reader.close()


def open_checkpoint(path: Union[str, Path], with_tokenizer: bool = True) -> Checkpoint:
    """Everything about a model that can be checked before a weight is read, each fault one ModelFormatError
    sentence: every file a regular file (engine/model_files.py), config.json or the GGUF metadata (sizes, values,
    architecture), the tokenizer built (a GGUF vocabulary converted; its chat template compiled), the shard index
    and the safetensors headers or the GGUF tensor records against the config. A model switch runs this while the
    previous model still serves, so that a broken model never takes its place."""
    folder = Path(path)
    if is_gguf_file(folder):
        config, tokenizer, reader = open_gguf(folder, with_tokenizer)
    else:
        config = ModelConfig.from_dir(folder)
        tokenizer = load_tokenizer(folder, config.bos_token_id, config.eos_token_ids) if with_tokenizer else None
        reader = WeightReader(folder)
    try:
        if isinstance(reader, WeightReader):
            reader.rename(config.description.stored_names(reader.names()))
            config = with_exl2_detected(config, reader.names())
        check_against_headers(config, reader)
    except BaseException:
        reader.close()
        raise
    return Checkpoint(folder, config, tokenizer, reader)


# The fewest positions a model is loaded with: a prompt's first token and one generated token.
MIN_SEQ_LEN = 2


def load_model(
    path: str | Path,
    device: str = "auto",
    dtype: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    embed_on_cpu: bool = False,
    rope_alpha: float = 1.0,
    compress_pos_emb: float = 1.0,
    layer_devices: Optional[Sequence[str]] = None,
    progress: Optional[Progress] = None,
    with_tokenizer: bool = True,
    cache_dtype: str = "fp16",
    speculative: str = "off",
    draft_model: Optional[Union[str, Path]] = None,
    draft_tokens: int = 0,
    checkpoint: Optional[Checkpoint] = None,
    threads: Optional[int] = None,
) -> LoadedModel:
    """Load a checkpoint of a registered architecture from a folder (dense or GPTQ 4-bit) or a GGUF file.

    `layer_devices` places each decoder layer (one entry per layer); otherwise all go to `device`.
    `with_tokenizer=False` skips the tokenizer (benchmarks on synthetic checkpoints). `cache_dtype` is the KV
    cache's storage (engine/cache.py CACHE_DTYPES: fp16 = the layers' dtype, q8, q4, k8v4).
    `speculative` ("off", "ngram", "draft") with `draft_model` and `draft_tokens`: see engine/speculative.py; the
    draft model (ignored when off) goes on the head's device with the target's dtype and context, and must share
    the tokenizer. `checkpoint`: the model already opened and checked by open_checkpoint(path) (taken over and
    closed here); without it load_model opens it. `threads`: CPU threads for torch and the native CPU kernels
    (default: the physical cores; engine/cpu_threads.py).
    """
    from kobold_backend.engine.cpu_threads import apply_threads
    from kobold_backend.engine.speculative import check_speculation

    try:
        check_speculation(speculative, draft_model, draft_tokens)
        cache_schemes(cache_dtype)
        if checkpoint is None:
            checkpoint = open_checkpoint(path, with_tokenizer)
    except BaseException:
        if checkpoint is not None:
            checkpoint.close()
        raise
    cpu_threads = apply_threads(threads)
    folder, config, tokenizer, reader = checkpoint.path, checkpoint.config, checkpoint.tokenizer, checkpoint.reader
    with reader:
        if speculative == "draft" and draft_model is not None and tokenizer is not None:
            draft = Path(draft_model)
            check_draft_tokenizer(tokenizer, _draft_tokenizer(draft), f"The draft model {draft.name}")
        main = resolve_device(device)
        compute_dtype = resolve_dtype(dtype, main, config)
        if layer_devices is not None and len(layer_devices) != config.num_layers:
            raise ValueError(f"layer_devices has {len(layer_devices)} entries for {config.num_layers} layers")
        seq_len = max_seq_len or min(config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        if seq_len < MIN_SEQ_LEN:
            raise ValueError(f"max_seq_len must be at least {MIN_SEQ_LEN}, not {seq_len}")
        if not config.features.quantized_cache and cache_schemes(cache_dtype) != ("fp16", "fp16"):
            raise ValueError(f"--cache-dtype {cache_dtype} cannot hold this model's latent attention cache, which is "
                             "kept in the model's dtype: use --cache-dtype fp16")
        for head_dim in sorted({config.layer_head_dim(i) for i in range(config.num_layers)}):
            check_cache_dtype(cache_dtype, head_dim)
        per_layer = [resolve_device(d) for d in layer_devices] if layer_devices else [main] * config.num_layers
        check_cache_memory(config, per_layer, compute_dtype, seq_len, cache_dtype)
        model = _build(reader, config, main, per_layer, compute_dtype, seq_len, embed_on_cpu,
                       rope_alpha, compress_pos_emb, progress, cache_dtype)
    fmt = stored_format(folder)  # the one computation of format and bits per weight, doctor's too
    log.info("loaded %s (%s, %s): %d layers, %.1f MB of weights on %s, %s KV cache, CPU threads: %d", folder.name,
             config.architecture, fmt, config.num_layers, model.nbytes / 1e6, main, cache_dtype, cpu_threads)
    lm = LoadedModel(model=model, tokenizer=tokenizer,  # type: ignore[arg-type]
                     config=config, path=folder, name=folder.name, weight_format=fmt)
    if speculative != "off":
        try:
            _attach_speculation(lm, speculative, draft_model, draft_tokens, compute_dtype, seq_len, progress)
        except BaseException:
            lm.unload()
            raise
    return lm


def _attach_speculation(lm: LoadedModel, mode: str, draft_model: Optional[Union[str, Path]], draft_tokens: int,
                        dtype: torch.dtype, seq_len: int, progress: Optional[Progress]) -> None:
    """Load the draft model (if any) next to the target's head and set lm.speculation."""
    from kobold_backend.engine.speculative import SpeculationConfig

    draft_lm = None
    if mode == "draft" and draft_model is not None:
        name = str(dtype).replace("torch.", "")
        try:
            draft_lm = load_model(draft_model, device=str(lm.model.device), dtype=name,
                                  max_seq_len=seq_len, progress=progress)
        except (ModelFormatError, OSError) as exc:
            raise ModelFormatError(f"The draft model {Path(draft_model).name} could not be loaded: {exc}") from exc
        lm.draft = draft_lm
        if draft_lm.model.recurrent:
            raise ModelFormatError(f"The draft model {Path(draft_model).name} has linear-attention layers, whose "
                                   "state cannot take back rejected draft tokens; choose a draft model without them.")
    lm.speculation = SpeculationConfig(mode, draft_tokens,
                                       None if draft_lm is None else draft_lm.model,
                                       "" if draft_lm is None else draft_lm.name)
    log.info("speculative decoding: %s", lm.speculation.describe())


def _draft_tokenizer(folder: Path) -> Tokenizer:
    """The draft model's tokenizer alone (no weights read), for the check before anything is loaded."""
    try:
        if is_gguf_file(folder):
            tokenizer = open_gguf(folder, True)[1]
        else:
            config = ModelConfig.from_dir(folder)
            tokenizer = load_tokenizer(folder, config.bos_token_id, config.eos_token_ids)
    except (ModelFormatError, OSError) as exc:
        raise ModelFormatError(f"The draft model {folder.name} could not be loaded: {exc}") from exc
    assert tokenizer is not None
    return tokenizer


def context_limit(config: ModelConfig, rope_alpha: float = 1.0, compress_pos_emb: float = 1.0) -> int:
    """The most positions a load may ask for: the trained context times the largest RoPE stretch in use (linear
    rope_scaling, NTK alpha, compress_pos_emb). llama3 scaling already states the stretched length."""
    factor = max(1.0, float(rope_alpha), float(compress_pos_emb))
    if config.rope_scaling is not None and config.rope_scaling.rope_type == "linear":
        factor = max(factor, config.rope_scaling.factor)
    return int(config.max_position_embeddings * factor)


def check_against_headers(config: ModelConfig, reader: Union[WeightReader, GGUFWeights]) -> None:
    """config.json against the safetensors headers before anything is allocated from its sizes: the layer count
    and the embedding shape must be those of the tensors in the files. Layers stored after the decoder's that
    inference does not run (`Architecture.unused_layers`: DeepSeek-V3's and GLM-4.5's multi-token prediction) may
    be present; they are not read."""
    layers = {int(name.split(".")[2]) for name in reader.names()
              if name.startswith("model.layers.") and name.split(".")[2].isdigit()}
    unused = config.description.unused_layers(config.raw)
    if layers != set(range(config.num_layers)) and layers != set(range(config.num_layers + unused)):
        raise ModelFormatError(
            f"config.json says num_hidden_layers {config.num_layers} but the checkpoint in {reader.folder} holds "
            f"{len(layers)} layers.")
    reader.get_shape_checked("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))


def _available_bytes(device: torch.device) -> Optional[int]:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def check_cache_memory(config: ModelConfig, per_layer: Sequence[torch.device], dtype: torch.dtype,
                       seq_len: int, cache_dtype: str = "fp16") -> None:
    """Refuse a context whose KV cache alone is larger than the free memory of a device it would go on."""
    need: Dict[torch.device, int] = {}
    heads, key, value = config.features.cache_shape
    for index, dev in enumerate(per_layer):
        if config.layer_kv_source(index) is not None:
            continue  # it reads an earlier layer's cache
        size = torch.tensor([], dtype=_dtype_for(dev, dtype)).element_size()
        state = config.description.state_bytes(config, index, size)  # a linear layer's state and its snapshots
        per_token = heads * (key + value) * size if heads else \
            cache_bytes_per_token(cache_dtype, config.layer_kv_heads(index), config.layer_head_dim(index), size)
        need[dev] = need.get(dev, 0) + (state * (1 + MAX_SNAPSHOTS) if state is not None else seq_len * per_token)
    for dev, nbytes in need.items():
        free = _available_bytes(dev)
        if free is not None and nbytes > free:
            raise ValueError(f"a context of {seq_len} tokens needs {nbytes / 2**30:.1f} GiB of KV cache on {dev} "
                             f"but {free / 2**30:.1f} GiB are free; choose a smaller context")


def _dtype_for(device: torch.device, compute: torch.dtype) -> torch.dtype:
    """Layers placed on the CPU compute in float32 whatever the GPU layers use."""
    return torch.float32 if device.type == "cpu" else compute


@dataclass
class LayerLoader:
    """What an architecture's `build_mlp` hook gets to read one layer's tensors: names are relative to `prefix`
    (`model.layers.N`), tensors land on the layer's device and dtype."""

    reader: Union[WeightReader, GGUFWeights]
    config: ModelConfig
    prefix: str
    device: torch.device
    dtype: torch.dtype

    def name(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def has(self, name: str) -> bool:
        return self.name(name) in self.reader

    def dense(self, name: str, shape: Tuple[int, ...], offset: float = 0.0) -> torch.Tensor:
        """A float tensor (`offset` added in float32 first: Gemma's (1 + weight) norms)."""
        t = self.reader.get(self.name(name), shape)
        if offset:
            t = t.float() + offset
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def linear(self, name: str, in_features: int, out_features: int) -> Weight:
        """A projection `name` (e.g. `mlp.down_proj`): GPTQ/AWQ/EXL2 when the checkpoint quantized it, else dense."""
        prefix = self.name(name)
        reader, quant = self.reader, self.config.quant
        if isinstance(reader, GGUFWeights):
            return reader.linear(prefix, in_features, out_features, self.device, self.dtype)
        if quant is not None and quant.method == "exl2":
            if is_exl2_linear(reader, prefix):
                return load_exl2_linear(reader, prefix, in_features, out_features, self.dtype, self.device)
            if f"{prefix}.weight" not in reader:
                raise ModelFormatError(f"config.json says EXL2 but {prefix} has no EXL2 tensors ({prefix}.q_weight "
                                       f"...) in {reader.folder}.")
        if quant is not None and quant.method == "awq" and f"{prefix}.qweight" in reader:
            return load_awq_linear(reader, prefix, in_features, out_features, quant, self.dtype, self.device)
        if quant is not None and f"{prefix}.qweight" in reader:
            return load_gptq_linear(reader, prefix, in_features, out_features, quant, self.dtype, self.device)
        if f"{prefix}.weight" not in reader and f"{prefix}.qweight" not in reader:
            raise ModelFormatError(f"Tensor {prefix}.weight is missing from the checkpoint in {reader.folder}.")
        if f"{prefix}.weight" not in reader:
            raise ModelFormatError(f"{prefix} is GPTQ-quantized but the folder has no quantization config.")
        return self.dense(f"{name}.weight", (out_features, in_features))


def _load_layer(ctx: LayerLoader, index: int) -> Layer:
    """One decoder layer as the architecture's layout names it; q/k/v and gate/up fused where they can be."""
    config = ctx.config
    arch = config.description
    layout = arch.layout(config, index)
    weights: Dict[str, Weight] = {}
    biases: Dict[str, torch.Tensor] = {}
    out_features: Dict[str, int] = {}
    for name, lin in layout.linears.items():
        if name not in Layer.PROJECTIONS:
            raise ValueError(f"{type(arch).__name__}.layout names {name!r}, which is no Layer projection "
                             f"({', '.join(Layer.PROJECTIONS)}); list it in mlp_linears and load it in build_mlp")
        weights[name] = ctx.linear(lin.prefix, lin.in_features, lin.out_features)
        out_features.update(dict(lin.parts))
        if name in layout.biased and not isinstance(weights[name], (GPTQWeight, GGMLWeight, EXL2Weight)):
            biases[name] = ctx.dense(f"{lin.prefix}.bias", (lin.out_features,))
    offset = config.features.norm_offset
    norms = {field_name: ctx.dense(f"{ckpt}.weight", size if isinstance(size, tuple) else (size,), offset)
             for field_name, (ckpt, size) in layout.norms.items()}
    norms.update({field_name: ctx.dense(ckpt, shape) for field_name, (ckpt, shape) in layout.extras.items()})
    norms.update(arch.layer_extras(ctx, config, index))  # Layer fields a description builds itself (Gemma 4)
    norms.setdefault("post_norm", None)  # a parallel block has no norm of its own in front of the MLP
    layer = Layer(
        q_proj=weights.get("q_proj"), k_proj=weights.get("k_proj"), v_proj=weights.get("v_proj"),
        o_proj=weights.get("o_proj"), gate_proj=weights.get("gate_proj"), up_proj=weights.get("up_proj"),
        down_proj=weights.get("down_proj"), qkv_proj=weights.get("qkv_proj"),
        gate_up_proj=weights.get("gate_up_proj"), device=ctx.device, out_features=out_features,
        biases=biases, mlp=arch.build_mlp(ctx, config, index), attn=arch.build_attention(ctx, config, index),
        mixer=arch.build_mixer(ctx, config, index), **norms,
    )
    fold_down_permutation(layer)
    layer.fuse()
    return layer


def _build(
    reader: Union[WeightReader, GGUFWeights],
    config: ModelConfig,
    main: torch.device,
    per_layer: List[torch.device],
    dtype: torch.dtype,
    seq_len: int,
    embed_on_cpu: bool,
    rope_alpha: float,
    compress_pos_emb: float,
    progress: Optional[Progress],
    cache_dtype: str = "fp16",
) -> Model:
    h = config.hidden_size
    total = config.num_layers + 2
    step = [0]

    def tick(message: str) -> None:
        step[0] += 1
        if progress is not None:
            progress(step[0], total, message)

    def top(device: torch.device, dt: torch.dtype) -> LayerLoader:
        return LayerLoader(reader, config, "model", device, dt)

    embed_device = torch.device("cpu") if embed_on_cpu else main
    embed = top(embed_device, _dtype_for(embed_device, dtype)).dense("embed_tokens.weight", (config.vocab_size, h))
    per_layer_embedding = config.description.per_layer_embedding(top(embed_device, embed.dtype), config)
    streams = config.description.residual_streams(top(embed_device, embed.dtype), config)
    tick("embeddings")
    layers: List[Layer] = []
    for i in range(config.num_layers):
        dev = per_layer[i]
        layers.append(_load_layer(LayerLoader(reader, config, f"model.layers.{i}", dev, _dtype_for(dev, dtype)), i))
        tick(f"layer {i + 1}/{config.num_layers}")
    head_dt = _dtype_for(main, dtype)
    norm = top(main, head_dt).dense("norm.weight", (h,), config.features.norm_offset)
    if config.tie_word_embeddings or not any(f"lm_head.{t}" in reader for t in ("weight", "qweight", "q_weight")):
        if not config.tie_word_embeddings:
            raise ModelFormatError(
                f"Tensor lm_head.weight is missing from the checkpoint in {reader.folder} "
                "and tie_word_embeddings is false."
            )
        lm_head: Weight = embed if embed.device == main and embed.dtype == head_dt else embed.to(main, head_dt)
    else:
        lm_head = LayerLoader(reader, config, "", main, head_dt).linear("lm_head", h, config.vocab_size)
    tick("head")
    tables: Dict[Tuple[torch.device, torch.dtype, Optional[RopeSpec], int], Tuple[torch.Tensor, torch.Tensor]] = {}
    cos, sin = [], []
    for index, layer in enumerate(layers):
        rope = config.layer_rope(index)
        # an attention object (DeepSeek's latent attention) reads a table of its rotated part only; q/k heads one
        # as wide as the layer's heads (Gemma 4's global layers are wider)
        width = rope.dim if rope is not None and layer.attn is not None else config.layer_head_dim(index)
        key = (layer.device, _dtype_for(layer.device, dtype), rope, width)
        if key not in tables:
            tables[key] = cos_sin_tables(config, seq_len, key[0], key[1], rope_alpha, compress_pos_emb, rope, width)
        cos.append(tables[key][0])
        sin.append(tables[key][1])
    return Model(config, embed, layers, norm, lm_head, cos, sin, head_dt, seq_len, cache_dtype, per_layer_embedding,
                 streams)
