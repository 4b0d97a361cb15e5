"""The built-in demo checkpoint, so the engine, the server and the plugin run without a download: the small trained
4-bit Llama shipped in the package (kobold_backend/demo/, see docs/demo-model.md).

When those files are absent (a checkout before the model was trained), a random-weight Llama with a sentencepiece
tokenizer trained on text found on this machine is built once into the user's cache instead, with a loud warning:
it writes gibberish and only exercises the stack.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pydoc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

import sentencepiece as spm
import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).resolve().parent / "demo"
# Not a training output: the plain "User:/Assistant:" template /v1/chat/completions renders for the demo model.
CHAT_TEMPLATE = SHIPPED_DIR / "chat_template.jinja"
SHIPPED_FILES = ("config.json", "quantize_config.json", "model.safetensors", "tokenizer.model",
                 "tokenizer_config.json", "generation_config.json")
DEMO_VERSION = "1"
Progress = Callable[[int, int, str], None]  # (done, total, message), as load_model reports

LICENSE_DIR = Path("/usr/share/common-licenses")
VOCAB_SIZE = 2000
HIDDEN = 256
LAYERS = 4
HEADS = 8
KV_HEADS = 4
INTERMEDIATE = 704
MAX_POSITIONS = 2048
SEED = 20240601
STALE_TEMP_SECONDS = 3600

README = """\
# kobold_backend demo model (random weights) - version {version}

This is a DEMO checkpoint built on this machine by `kobold_backend.demo.ensure_demo_model()`.
Its weights are RANDOM: it has never been trained, and it WRITES GIBBERISH.
Use it only to check that the engine, the HTTP server or the KoboldAI plugin work end to end;
load a real model (a dense or 4-bit GPTQ Llama-family safetensors folder) to get real text.

- architecture: Llama, {layers} layers, hidden {hidden}, {heads} heads ({kv_heads} KV heads), float16
- weights: random (seed {seed}), never trained
- tokenizer: sentencepiece BPE ({vocab} pieces, byte fallback) trained on {corpus}
- safe to delete: it is rebuilt (in a few seconds) the next time it is needed
"""


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/kobold_backend, else ~/.cache/kobold_backend."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kobold_backend"


def shipped_demo_dir() -> Optional[Path]:
    """The trained demo checkpoint inside the installed package, or None when any of its files is absent."""
    if all((SHIPPED_DIR / name).is_file() for name in SHIPPED_FILES):
        return SHIPPED_DIR
    return None


def demo_label(path: Optional[Union[str, Path]] = None) -> str:
    """How to present the demo model at `path` (default: the one ensure_demo_model would give) to a person."""
    shipped = shipped_demo_dir()
    if shipped is not None and (path is None or Path(path).resolve() == shipped.resolve()):
        return ("Demo model: a tiny 6.5M-parameter Llama trained on licence texts and Python's documentation "
                "(4-bit); it writes plausible fragments, not answers. Load a real model for real use.")
    return "Demo model: random weights, the output is gibberish (the trained demo model is not installed)."


def ensure_demo_model(cache_dir: Optional[Union[str, Path]] = None, progress: Optional[Progress] = None) -> Path:
    """Return the demo model folder: the trained checkpoint shipped in the package when it is there (nothing is
    built, `progress` is not called); otherwise the random-weight fallback, built first if needed under
    `cache_dir` (default ~/.cache/kobold_backend), with a warning that it writes gibberish.
    """
    shipped = shipped_demo_dir()
    if shipped is not None:
        return shipped
    log.warning(
        "THE TRAINED DEMO MODEL IS NOT INSTALLED (%s lacks its files): falling back to a RANDOM-WEIGHT model that "
        "writes GIBBERISH. Reinstall kobold-backend, or pass --model with a real model folder.", SHIPPED_DIR
    )
    return build_random_demo_model(cache_dir, progress)


def build_random_demo_model(cache_dir: Optional[Union[str, Path]] = None,
                            progress: Optional[Progress] = None) -> Path:
    """Return the random-weight demo folder, building it first if needed (under `cache_dir`, default
    ~/.cache/kobold_backend).

    The folder is written under a temporary name and renamed into place, so it is either complete or absent;
    a failed or interrupted build leaves nothing behind (stale temporary folders are removed on the next build).
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"demo-{DEMO_VERSION}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".demo-{DEMO_VERSION}-", dir=str(root)))
    try:
        _build(tmp, progress)
        if final.exists() and not (final / "config.json").is_file():
            shutil.rmtree(final)  # not something this function wrote: it only ever renames complete folders
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first; keep its copy
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("built the demo model (random weights) at %s", final)
    return final


def _remove_stale_temps(root: Path) -> None:
    now = time.time()
    for path in root.glob(".demo-*"):
        try:
            if path.is_dir() and now - path.stat().st_mtime > STALE_TEMP_SECONDS:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def corpus_lines() -> Tuple[List[str], str]:
    """Text to train the tokenizer on, and where it came from: the licence texts shipped with the OS, else
    Python's own documentation."""
    lines: List[str] = []
    source = f"the licence texts in {LICENSE_DIR}"
    if LICENSE_DIR.is_dir():
        for path in sorted(LICENSE_DIR.iterdir()):
            if path.is_file():
                lines.extend(path.read_text(encoding="utf-8", errors="replace").splitlines())
    if sum(len(line) for line in lines) < 100_000:
        source = "Python's own documentation (pydoc)"
        for name in ["builtins", "os", "json", "re", "pathlib", "typing", "collections", "functools", "itertools",
                     "string", "textwrap", "argparse", "logging", "unittest", "email", "http.client"]:
            try:
                lines.extend(pydoc.render_doc(name, renderer=pydoc.plaintext).splitlines())
            except ImportError:
                continue
    return [line.strip() for line in lines if line.strip()], source


def _train_tokenizer(lines: List[str]) -> bytes:
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        byte_fallback=True,
        character_coverage=0.9995,
        split_digits=True,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    return buf.getvalue()


def _random_weights(vocab: int) -> Dict[str, torch.Tensor]:
    """Linears ~ N(0, 1/fan_in) so activations stay O(1); logits of a few units (output is varied, not constant)."""
    g = torch.Generator().manual_seed(SEED)
    head_dim = HIDDEN // HEADS

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return (gain / math.sqrt(in_f) * torch.randn(out_f, in_f, generator=g)).half()

    t: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(vocab, HIDDEN, generator=g).half()}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.float16)
        t[p + "self_attn.q_proj.weight"] = lin(HEADS * head_dim, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = lin(KV_HEADS * head_dim, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = lin(KV_HEADS * head_dim, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = lin(HIDDEN, HEADS * head_dim)
        t[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.float16)
        t[p + "mlp.gate_proj.weight"] = lin(INTERMEDIATE, HIDDEN)
        t[p + "mlp.up_proj.weight"] = lin(INTERMEDIATE, HIDDEN)
        t[p + "mlp.down_proj.weight"] = lin(HIDDEN, INTERMEDIATE)
    t["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.float16)
    t["lm_head.weight"] = lin(vocab, HIDDEN, gain=3.0)
    return t


def _config(vocab: int) -> Dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16",
        "kobold_backend_demo": DEMO_VERSION,
    }


def _build(folder: Path, progress: Optional[Progress]) -> None:
    total = 4

    def report(done: int, message: str) -> None:
        if progress is not None:
            progress(done, total, message)

    lines, corpus = corpus_lines()
    report(0, "training tokenizer")
    model_bytes = _train_tokenizer(lines)
    (folder / "tokenizer.model").write_bytes(model_bytes)
    vocab = spm.SentencePieceProcessor(model_proto=model_bytes).get_piece_size()
    specials = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    tok_config = dict(specials, tokenizer_class="LlamaTokenizer", add_bos_token=True, add_eos_token=False)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    if CHAT_TEMPLATE.is_file():
        (folder / CHAT_TEMPLATE.name).write_text(CHAT_TEMPLATE.read_text(encoding="utf-8"), encoding="utf-8")
    report(1, "random weights")
    weights = _random_weights(vocab)
    report(2, "writing weights")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2))
    (folder / "README.md").write_text(README.format(
        version=DEMO_VERSION, layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, seed=SEED,
        vocab=vocab, corpus=corpus,
    ))
    report(3, "config")
    # config.json last: its presence marks a complete folder
    (folder / "config.json").write_text(json.dumps(_config(vocab), indent=2))
    report(4, "done")
