"""Train, quantize and evaluate the shipped demo model, and install its files into the package.

    python tools/build_demo_corpus.py .demo_corpus
    python tools/train_demo.py train --corpus .demo_corpus --out OUT [--minutes 4] [--tiny]
    python tools/train_demo.py install OUT          # copies OUT's files into kobold_backend/demo/, writes the card

`train` trains a sentencepiece BPE tokenizer and a small Llama (transformers' LlamaForCausalLM, AdamW, cosine
schedule, bf16 autocast on CUDA) on the corpus's train split, picking the epoch count by validation loss on 2% of
the train documents; writes the dense checkpoint under --work, quantizes it to 4-bit GPTQ with
kobold_backend.quantize, and measures held-out perplexity of the dense and the 4-bit checkpoints with this engine
(kobold_backend.engine.loader.load_model + Model.forward, float32 on the CPU). OUT receives, flat, the six shipped
files and report.json.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without installing

import sentencepiece as spm  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from kobold_backend.engine.loader import load_model  # noqa: E402
from kobold_backend.quantize import quantize_checkpoint  # noqa: E402

log = logging.getLogger("train_demo")

SHIPPED_FILES = ("config.json", "quantize_config.json", "model.safetensors", "tokenizer.model",
                 "tokenizer_config.json", "generation_config.json")
SHIP_DIR = REPO / "kobold_backend" / "demo"
CARD = REPO / "docs" / "demo-model.md"
MAX_SHIPPED_BYTES = 10_000_000
VALID_PERMILLE = 20
PROMPTS = ("This program is free software", "Return the number of", "The GNU General Public License",
           "class ", "If the Library is modified so that")


@dataclass(frozen=True)
class Preset:
    """Model shape and training settings."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context: int
    batch: int
    lr: float
    warmup: int
    dropout: float
    weight_decay: float
    epoch_choices: Tuple[int, ...]  # cosine runs of these many epochs; the best on validation is kept
    calibration: int  # GPTQ calibration windows of `context` tokens
    group_size: int
    eval_docs: int  # held-out documents evaluated with the engine (0: all)
    greedy_tokens: int  # tokens generated for each prompt of the card


FULL = Preset(hidden=256, layers=6, heads=8, kv_heads=4, intermediate=704, vocab=4096, context=512, batch=16,
              lr=1.5e-3, warmup=200, dropout=0.1, weight_decay=0.1, epoch_choices=(20, 10, 40), calibration=128,
              group_size=64, eval_docs=0, greedy_tokens=48)
TINY = Preset(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=192, vocab=1000, context=64, batch=8,
              lr=3e-3, warmup=10, dropout=0.0, weight_decay=0.1, epoch_choices=(1,), calibration=16,
              group_size=64, eval_docs=12, greedy_tokens=8)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def text_hash(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


# ------------------------------------------------------------------------------------------------ data


def load_corpus(folder: Path) -> Tuple[List[Dict[str, str]], List[Dict[str, str]], Dict[str, Any]]:
    """(train documents, held-out documents, manifest), after checking the files against the manifest."""
    manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    splits = []
    for name in ("train.jsonl", "heldout.jsonl"):
        path = folder / name
        expected = manifest["files"][name]["sha256"]
        actual = sha256_file(path)
        if actual != expected:
            raise SystemExit(f"{path} has sha256 {actual}, the manifest says {expected}: rebuild the corpus")
        with open(path, encoding="utf-8") as fh:
            splits.append([json.loads(line) for line in fh])
    return splits[0], splits[1], manifest


def split_valid(docs: List[Dict[str, str]]) -> Tuple[List[Dict[str, str]], List[Dict[str, str]]]:
    """Validation = documents whose text hash (bytes 8..16, unlike the held-out rule) falls in 2%."""
    def is_valid(doc: Dict[str, str]) -> bool:
        return int.from_bytes(text_hash(doc["text"])[8:16], "big") % 1000 < VALID_PERMILLE

    return [d for d in docs if not is_valid(d)], [d for d in docs if is_valid(d)]


def train_tokenizer(docs: List[Dict[str, str]], vocab: int, seed: int) -> bytes:
    """Llama-style sentencepiece BPE (byte fallback, unk 0 / bos 1 / eos 2) on the documents' non-empty lines."""
    lines = [line for d in docs for line in d["text"].split("\n") if line.strip()]
    spm.set_random_generator_seed(seed)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, model_type="bpe", vocab_size=vocab, byte_fallback=True,
        character_coverage=0.9995, split_digits=True, normalization_rule_name="identity", add_dummy_prefix=True,
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, num_threads=max(1, os.cpu_count() or 1), minloglevel=2,
    )
    return buf.getvalue()


def encode_docs(sp: spm.SentencePieceProcessor, docs: List[Dict[str, str]]) -> List[List[int]]:
    """Each document as [bos] + pieces + [eos]."""
    return [[sp.bos_id()] + sp.encode(d["text"]) + [sp.eos_id()] for d in docs]


def stream(encoded: List[List[int]], seed: int) -> torch.Tensor:
    """The documents concatenated in a seeded random order."""
    order = torch.randperm(len(encoded), generator=torch.Generator().manual_seed(seed)).tolist()
    return torch.tensor([t for i in order for t in encoded[i]], dtype=torch.long)


def chunks(encoded: List[List[int]], context: int) -> List[Tuple[int, List[int]]]:
    """(document index, piece) for each document cut into pieces of at most `context` tokens (pieces of one
    token predict nothing)."""
    return [(d, doc[i:i + context]) for d, doc in enumerate(encoded) for i in range(0, len(doc), context)
            if len(doc[i:i + context]) > 1]


# ------------------------------------------------------------------------------------------------ model


def hf_config(p: Preset, vocab: int) -> Dict[str, Any]:
    """config.json of the dense checkpoint (the 4-bit one adds quantization_config)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": p.hidden,
        "intermediate_size": p.intermediate, "num_hidden_layers": p.layers, "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads, "head_dim": p.hidden // p.heads, "hidden_act": "silu",
        "max_position_embeddings": p.context, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "vocab_size": vocab,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16", "kobold_backend_demo": "trained",
    }


def build_model(p: Preset, vocab: int, seed: int, device: torch.device) -> torch.nn.Module:
    """LlamaForCausalLM with residual dropout: `p.dropout` on each attention and MLP branch output."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = hf_config(p, vocab)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",
                                                                                      "torch_dtype")}))
    if p.dropout > 0:
        def drop(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
            return F.dropout(output, p.dropout, training=module.training)

        for layer in model.model.layers:
            layer.self_attn.o_proj.register_forward_hook(drop)
            layer.mlp.register_forward_hook(drop)
    return model.to(device)


def n_params(model: torch.nn.Module) -> int:
    return sum(t.numel() for t in model.parameters())


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def windows(data: torch.Tensor, length: int) -> torch.Tensor:
    n = (len(data) - 1) // length
    return torch.stack([data[i * length:i * length + length + 1] for i in range(n)])


@torch.no_grad()
def valid_loss(model: torch.nn.Module, valid: torch.Tensor, p: Preset, device: torch.device) -> float:
    model.eval()
    total, count = 0.0, 0
    for batch in torch.split(valid, p.batch * 4):
        with autocast(device):
            loss = lm_loss(model, batch.to(device))
        total += float(loss) * batch.shape[0]
        count += batch.shape[0]
    model.train()
    return total / max(count, 1)


def autocast(device: torch.device) -> Any:
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def train_one(
    p: Preset, epochs: float, data: torch.Tensor, valid: torch.Tensor, vocab: int, seed: int,
    device: torch.device, deadline: float, max_steps: Optional[int],
) -> Dict[str, Any]:
    """One cosine run of `epochs` epochs (or `max_steps`); validation once an epoch; keeps the best state."""
    model = build_model(p, vocab, seed, device)
    decay = [t for n, t in model.named_parameters() if t.dim() >= 2]
    no_decay = [t for n, t in model.named_parameters() if t.dim() < 2]
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": p.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=p.lr, betas=(0.9, 0.95), **fused)
    per_epoch = max(1, len(data) // (p.batch * p.context))
    total = max_steps if max_steps is not None else max(1, int(epochs * per_epoch))
    gen = torch.Generator().manual_seed(seed + 1)
    curve: List[Tuple[int, float]] = []
    vcurve: List[Tuple[int, float]] = []
    best: Tuple[float, int, Optional[Dict[str, torch.Tensor]]] = (math.inf, 0, None)
    start = time.time()
    step = 0
    model.train()
    while step < total:
        lr = p.lr * min(1.0, (step + 1) / p.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total)))
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(data) - p.context - 1, (p.batch,), generator=gen)
        batch = torch.stack([data[o:o + p.context + 1] for o in offsets.tolist()]).to(device, non_blocking=True)
        with autocast(device):
            loss = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        loss = loss.detach()
        if step % 25 == 0 or step == total:
            curve.append((step, round(float(loss), 4)))
        out_of_time = time.time() > deadline
        if step % per_epoch == 0 or step == total or out_of_time:
            v = valid_loss(model, valid, p, device)
            vcurve.append((step, round(v, 4)))
            log.info("epochs %d: step %d/%d loss %.4f valid %.4f lr %.2e (%.0fs)", epochs, step, total,
                     float(loss), v, lr, time.time() - start)
            if v < best[0]:
                best = (v, step, {k: t.detach().to("cpu", copy=True) for k, t in model.state_dict().items()})
        if out_of_time:
            log.warning("time budget reached at step %d of %d", step, total)
            break
    return {"epochs": epochs, "steps": step, "planned_steps": total, "steps_per_epoch": per_epoch,
            "seconds": round(time.time() - start, 1), "best_valid_loss": best[0], "best_step": best[1],
            "loss_curve": curve, "valid_curve": vcurve, "state": best[2],
            "tokens_seen": step * p.batch * p.context}


# ------------------------------------------------------------------------------------------------ files


def write_dense(folder: Path, state: Dict[str, torch.Tensor], p: Preset, vocab: int, tokenizer: bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: t.to(torch.float16).contiguous() for k, t in state.items() if k.endswith(".weight")}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(p, vocab), indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2)
                                                   + "\n")
    (folder / "tokenizer.model").write_bytes(tokenizer)
    tok_config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                  "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "legacy": True,
                  "model_max_length": p.context}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------ evaluation


def engine_nll(folder: Path, pieces: List[List[int]], context: int) -> List[float]:
    """Per piece, the sum of -log p(token | the piece's earlier tokens) with this engine on the CPU in float32."""
    lm = load_model(folder, device="cpu", dtype="float32", max_seq_len=context)
    cache = lm.model.new_cache(max_seq_len=context)
    out = []
    for piece in pieces:
        cache.reset()
        logits = lm.model.forward(torch.tensor([piece]), cache, last_only=False)[0]
        logp = torch.log_softmax(logits[:-1].double(), dim=-1)
        out.append(-float(logp.gather(1, torch.tensor(piece[1:]).unsqueeze(1)).sum()))
    lm.unload()
    return out


@torch.no_grad()
def torch_nll(model: torch.nn.Module, pieces: List[List[int]], device: torch.device) -> List[float]:
    """The same with the training model in float32 (a cross-check of the engine's dense number)."""
    model.eval().float()
    out = []
    for piece in pieces:
        logits = model(input_ids=torch.tensor([piece], device=device)).logits[0].double()
        target = torch.tensor(piece[1:], device=device).unsqueeze(1)
        out.append(-float(torch.log_softmax(logits[:-1], -1).gather(1, target).sum()))
    return out


def perplexities(nll: List[float], pieces: List[List[int]], kinds: List[str]) -> Dict[str, float]:
    """exp(mean nll per predicted token): over all pieces ("all") and per document source kind."""
    result = {}
    for kind in ["all"] + sorted(set(kinds)):
        sel = [i for i, k in enumerate(kinds) if kind in ("all", k)]
        tokens = sum(len(pieces[i]) - 1 for i in sel)
        result[kind] = round(math.exp(sum(nll[i] for i in sel) / tokens), 4)
    return result


def greedy(folder: Path, sp: spm.SentencePieceProcessor, prompts: Sequence[str], n: int,
           context: int) -> Dict[str, str]:
    """Each prompt with its greedy continuation (at most n tokens, stopping at eos) by this engine."""
    lm = load_model(folder, device="cpu", dtype="float32", max_seq_len=context)
    cache = lm.model.new_cache(max_seq_len=context)
    result = {}
    for prompt in prompts:
        ids = [sp.bos_id()] + sp.encode(prompt)
        cache.reset()
        logits = lm.model.forward(torch.tensor([ids]), cache)
        out: List[int] = []
        while len(out) < n and len(ids) + len(out) < context:
            token = int(logits[0, -1].argmax())
            if token == sp.eos_id():
                break
            out.append(token)
            logits = lm.model.forward(torch.tensor([[token]]), cache)
        result[prompt] = sp.decode(ids[1:] + out)
    lm.unload()
    return result


def pick_sample(heldout: List[Dict[str, str]]) -> Dict[str, str]:
    """A held-out prose paragraph for the card and the test: of the documentation (not licence) documents of
    200-600 characters that are mostly letters and spaces, the one with the smallest text hash. Licence
    paragraphs are avoided: other versions of the same licence in the train split hold near copies."""
    def prose(text: str) -> bool:
        return 200 <= len(text) <= 600 and sum(c.isalpha() or c == " " for c in text) >= 0.9 * len(text)

    docs = [d for d in heldout if not d["source"].startswith("license:")] or heldout
    candidates = [d for d in docs if prose(d["text"])] or docs
    return min(candidates, key=lambda d: text_hash(d["text"]))


def sample_ppl(folder: Path, sp: spm.SentencePieceProcessor, text: str, context: int) -> float:
    """Perplexity of [bos] + text, every token after bos predicted (tests/test_demo_model.py computes the same)."""
    piece = ([sp.bos_id()] + sp.encode(text))[:context]
    return math.exp(engine_nll(folder, [piece], context)[0] / (len(piece) - 1))


# ------------------------------------------------------------------------------------------------ commands


def cmd_train(args: argparse.Namespace) -> int:
    os.environ.setdefault("KOBOLD_BACKEND_EXT", "torch")  # evaluate with the reference ops: no kernel build
    p = TINY if args.tiny else FULL
    if args.epochs:
        p = replace(p, epoch_choices=tuple(args.epochs))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="demo-train-"))
    started = time.time()
    deadline = started + args.minutes * 60

    train_docs, heldout_docs, manifest = load_corpus(Path(args.corpus))
    train_docs, valid_docs = split_valid(train_docs)
    log.info("corpus: %d train, %d validation, %d held-out documents", len(train_docs), len(valid_docs),
             len(heldout_docs))
    tokenizer = train_tokenizer(train_docs, p.vocab, args.seed)
    sp = spm.SentencePieceProcessor(model_proto=tokenizer)
    vocab = sp.get_piece_size()
    data = stream(encode_docs(sp, train_docs), args.seed)
    valid = windows(stream(encode_docs(sp, valid_docs), args.seed), p.context)
    log.info("tokens: %d train, %d validation windows; vocabulary %d", len(data), len(valid), vocab)

    runs = []
    for epochs in p.epoch_choices:
        if runs:
            per_step = runs[-1]["seconds"] / max(runs[-1]["steps"], 1)
            need = per_step * (args.steps or epochs * runs[-1]["steps_per_epoch"])
            if time.time() + need > deadline:
                log.warning("skipping the %d-epoch run: it needs ~%.0fs, %.0fs are left", epochs, need,
                            deadline - time.time())
                continue
        runs.append(train_one(p, epochs, data, valid, vocab, args.seed, device, deadline, args.steps))
    chosen = min(runs, key=lambda r: r["best_valid_loss"])
    log.info("chosen: %d epochs, best validation loss %.4f at step %d", chosen["epochs"],
             chosen["best_valid_loss"], chosen["best_step"])
    train_seconds = time.time() - started
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # full float32 for the Hessians and the cross-check

    dense = work / "dense"
    write_dense(dense, chosen["state"], p, vocab, tokenizer)
    model = build_model(replace(p, dropout=0.0), vocab, args.seed, device)
    model.load_state_dict({k: v.to(torch.float16).float() for k, v in chosen["state"].items()})

    calib = windows(data, p.context - 1)
    pick = torch.randperm(len(calib), generator=torch.Generator().manual_seed(args.seed + 2))[:p.calibration]
    quant = quantize_checkpoint(dense, out, calibration=calib[pick], group_size=p.group_size, method="gptq",
                                device=str(device))
    rtn_dir = work / "rtn"
    quantize_checkpoint(dense, rtn_dir, group_size=p.group_size, method="rtn")

    eval_docs = heldout_docs if not p.eval_docs else heldout_docs[:p.eval_docs]
    indexed = chunks(encode_docs(sp, eval_docs), p.context)
    pieces = [piece for _, piece in indexed]
    kinds = [eval_docs[d]["source"].split(":")[0] for d, _ in indexed]
    ppl: Dict[str, float] = {}
    by_source: Dict[str, Dict[str, float]] = {}
    for key, fn in (("dense_torch", lambda: torch_nll(model, pieces, device)),
                    ("dense_engine", lambda: engine_nll(dense, pieces, p.context)),
                    ("gptq4_engine", lambda: engine_nll(out, pieces, p.context)),
                    ("rtn4_engine", lambda: engine_nll(rtn_dir, pieces, p.context))):
        by_source[key] = perplexities(fn(), pieces, kinds)
        ppl[key] = by_source[key]["all"]
        log.info("held-out perplexity %s: %s", key, by_source[key])
    sample = pick_sample(heldout_docs)
    errors = quant["relative_output_error"]
    files = {name: {"sha256": sha256_file(out / name), "bytes": (out / name).stat().st_size}
             for name in SHIPPED_FILES}
    report = {
        "preset": "tiny" if args.tiny else "full",
        "settings": asdict(p),
        "seed": args.seed,
        "corpus": {"manifest": manifest, "train_documents": len(train_docs), "validation_documents": len(valid_docs),
                   "heldout_documents": len(heldout_docs), "train_tokens": len(data)},
        "tokenizer": {"type": "sentencepiece BPE, byte fallback, unk 0 / bos 1 / eos 2", "vocab_size": vocab},
        "model": {"config": hf_config(p, vocab), "parameters": n_params(model)},
        "training": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "optimizer": "AdamW betas (0.9, 0.95), weight decay on matrices, grad clip 1.0",
                     "schedule": f"linear warmup {p.warmup} steps, cosine to 10% of {p.lr}",
                     "autocast": "bf16" if device.type == "cuda" else "none (fp32)",
                     "seconds_total": round(train_seconds, 1), "chosen_epochs": chosen["epochs"],
                     "runs": [{k: v for k, v in r.items() if k != "state"} for r in runs]},
        "quantization": {k: v for k, v in quant.items() if k != "relative_output_error"},
        "quantization_error": {
            "mean_gptq": round(sum(e["gptq"] for e in errors.values()) / len(errors), 5),
            "mean_rtn": round(sum(e["rtn"] for e in errors.values()) / len(errors), 5),
            "per_linear": errors},
        "heldout_eval": {"documents": len(eval_docs), "tokens": sum(len(x) - 1 for x in pieces),
                         "pieces": len(pieces), "perplexity": ppl, "perplexity_by_source": by_source,
                         "gptq4_vs_dense": round(ppl["gptq4_engine"] / ppl["dense_engine"] - 1, 4)},
        "sample": {"source": sample["source"], "text": sample["text"],
                   "perplexity_gptq4_engine": round(sample_ppl(out, sp, sample["text"], p.context), 4),
                   "perplexity_dense_engine": round(sample_ppl(dense, sp, sample["text"], p.context), 4)},
        "greedy": greedy(out, sp, PROMPTS, p.greedy_tokens, p.context),
        "files": files,
        "shipped_bytes": sum(f["bytes"] for f in files.values()),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__, "sentencepiece": spm.__version__},
        "seconds": round(time.time() - started, 1),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    log.info("wrote %s (%d shipped bytes), held-out perplexity dense %.3f, 4-bit %.3f", out,
             report["shipped_bytes"], ppl["dense_engine"], ppl["gptq4_engine"])
    if report["shipped_bytes"] > MAX_SHIPPED_BYTES:
        log.error("the shipped files are %d bytes, over %d", report["shipped_bytes"], MAX_SHIPPED_BYTES)
        return 1
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    src = Path(args.run_dir)
    report = json.loads((src / "report.json").read_text(encoding="utf-8"))
    if report["preset"] != "full" and not args.allow_tiny:
        raise SystemExit(f"{src} holds a {report['preset']} run; only a full run is shipped")
    for name in SHIPPED_FILES:
        if sha256_file(src / name) != report["files"][name]["sha256"]:
            raise SystemExit(f"{src / name} does not match the sha256 in report.json")
    ship = Path(args.ship_dir)
    ship.mkdir(parents=True, exist_ok=True)
    for name in SHIPPED_FILES:
        shutil.copyfile(src / name, ship / name)
    Path(args.card).write_text(render_card(report), encoding="utf-8")
    log.info("installed %d files into %s and wrote %s", len(SHIPPED_FILES), ship, args.card)
    return 0


def cmd_card(args: argparse.Namespace) -> int:
    """Write the card of a model not trained yet (the template the install step fills)."""
    Path(args.card).write_text(render_card(None), encoding="utf-8")
    return 0


# ------------------------------------------------------------------------------------------------ card

CARD_HEAD = """\
# The demo model

`kobold-backend serve` (and `generate`, and the plugin's install check) run this model when no model is given.
It ships inside the package (`kobold_backend/demo/`), so nothing is downloaded. It is a **tiny** Llama-architecture
model trained from scratch on redistributable text found on a Debian machine: the licence texts in
`/usr/share/common-licenses` and Python's own documentation (standard-library docstrings and pydoc's help topics).
It writes English in the style of software licences and Python docstrings; it is a demonstration that the whole
stack works, not an assistant.

It ships a plain chat template (`kobold_backend/demo/chat_template.jinja`, written by hand, not by the training
tool: a system message as a paragraph, then `User: ...` and `Assistant: ...` lines, ending in `Assistant:`), so
`/v1/chat/completions` and OpenAI chat clients work with no `--chat-template`. The model never saw a chat: its
replies continue the text in its usual register and run until `max_tokens`, an end of text or a stop string
(send `stop: ["\\nUser:"]` to end a reply at the next turn).

## What it is not good for

- Facts, instructions, chat, stories, code that runs: it has seen about a million tokens of licences and API
  documentation and nothing else. It will confidently continue any prompt in that register.
- Long context: it was trained on windows of {context} tokens and its context is {context}.
- Anything where the licence text matters: it recombines licence paragraphs; its output is not a licence.
- Judging this engine's speed on real models: it is far smaller than any real model.

## How it was made

1. `python tools/build_demo_corpus.py .demo_corpus`: licence paragraphs, pydoc help topics and standard-library
   docstrings, normalised (NFC, tabs expanded, trailing spaces and control characters removed), deduplicated on the
   case- and whitespace-folded body; a document is held out when the first 8 bytes of the sha256 of its text
   modulo 1000 are below 50 (5%).
2. `python tools/train_demo.py train --corpus .demo_corpus --out OUT --minutes 4` on one GPU: sentencepiece BPE
   ({vocab} pieces, byte fallback, unk 0 / bos 1 / eos 2) trained on the train split; a Llama with hidden
   {hidden}, {layers} layers, {heads} heads ({kv_heads} KV heads), MLP {intermediate}, context {context}, untied
   embeddings; AdamW (betas 0.9/0.95, weight decay {weight_decay} on matrices, clip 1.0), peak learning rate {lr},
   {warmup} warm-up steps then cosine to 10%, batch {batch} x {context} tokens, residual dropout {dropout}, bf16
   autocast, seed {seed}. One cosine run per epoch count in {epoch_choices} (in that order; a run that would
   overrun the time budget is skipped); the run and step with the lowest loss on a validation set (2% of the train
   documents, chosen by another slice of the text hash) are kept.
3. The dense checkpoint (fp16) is quantized by this project's own GPTQ implementation (`kobold_backend.quantize`,
   real GPTQ: Hessian from calibration activations, true-sequential, damping 1%) to 4 bits, group size
   {group_size}, symmetric, v1 `gptq` format, no act-order, from {calibration} calibration windows of the train
   split; embeddings, norms and `lm_head` stay fp16.
4. Held-out perplexity is measured with this engine (`load_model` + `Model.forward`, float32 on the CPU) on every
   held-out document, cut into pieces of at most {context} tokens, each piece starting a fresh cache; perplexity is
   exp(mean negative log-likelihood) over every token after a piece's first.
5. `python tools/train_demo.py install OUT` copies the six files into `kobold_backend/demo/` and writes this card.
"""

CARD_PENDING = """
## Status: not trained yet

The trained checkpoint has not been produced yet; until it is, `ensure_demo_model()` falls back to a random-weight
model built in the user's cache (gibberish, with a loud warning) and `tests/test_demo_model.py` skips its checks of
the shipped files. `tools/train_demo.py install` replaces this section with the results: size, held-out
perplexity of the dense and the 4-bit model, corpus and file hashes, greedy samples, and the record the test reads.
"""

CARD_RESULT = """
## Results

| | value |
|---|---|
| parameters | {parameters:,} |
| shipped size (six files) | {shipped_bytes:,} bytes |
| training run kept | {chosen_epochs} epochs: {steps} steps, {tokens_seen:,} tokens, best at step {best_step} |
| training time (all runs) | {train_seconds} s on {device} |
| documents | {train_docs} train / {valid_docs} validation / {heldout_docs} held-out |
| train tokens | {train_tokens:,} |
| held-out perplexity, dense fp16 (engine) | {ppl_dense} |
| held-out perplexity, dense (transformers, cross-check) | {ppl_torch} |
| held-out perplexity, 4-bit GPTQ (engine) | {ppl_gptq} ({gptq_delta:+.1%} vs dense) |
| held-out perplexity, 4-bit round-to-nearest (engine, for comparison) | {ppl_rtn} |
| mean relative output error per linear, GPTQ / RTN | {err_gptq} / {err_rtn} |
| held-out tokens evaluated | {eval_tokens:,} in {eval_pieces} pieces |

Held-out perplexity by source, dense / 4-bit: {by_source}. Licence paragraphs have near copies in the train
split (other versions of the same licence), so their perplexity flatters the model; the documentation sources
(`pydoc`: imported docstrings, `source`: docstrings read from the library's files, `topic`: help topics) are
closer to what new text would get.

Validation loss of each run: {runs}.

Built with Python {py}, torch {torch}, transformers {transformers}, sentencepiece {sentencepiece}.

### Corpus files (rebuilt by `tools/build_demo_corpus.py`, not committed; built with Python {corpus_python})

| file | sha256 | bytes | documents |
|---|---|---|---|
{corpus_rows}

### Shipped files (`kobold_backend/demo/`)

| file | sha256 | bytes |
|---|---|---|
{file_rows}

### Greedy continuations (4-bit, engine)

{greedy}

### Held-out sample

The test (`tests/test_demo_model.py`) scores this held-out document ({sample_source}) against a random-weight
model of the same shape and checks the perplexity recorded here:

> {sample_quoted}

## Record

The test reads this block.

```json
{record}
```
"""


def render_card(report: Optional[Dict[str, Any]]) -> str:
    s = FULL if report is None else Preset(**{k: tuple(v) if isinstance(v, list) else v
                                              for k, v in report["settings"].items()})
    head = CARD_HEAD.format(seed=1234 if report is None else report["seed"], **asdict(s))
    if report is None:
        return head + CARD_PENDING
    t = report["training"]
    chosen = next(r for r in t["runs"] if r["epochs"] == t["chosen_epochs"])
    ppl = report["heldout_eval"]["perplexity"]
    c = report["corpus"]
    corpus_rows = "\n".join(f"| {n} | `{f['sha256']}` | {f['bytes']} | {f['documents']} |"
                            for n, f in c["manifest"]["files"].items())
    file_rows = "\n".join(f"| {n} | `{f['sha256']}` | {f['bytes']} |" for n, f in report["files"].items())
    greedy_text = "\n".join(f"- `{prompt}` -> {json.dumps(text)}" for prompt, text in report["greedy"].items())
    record = {
        "files": {n: f["sha256"] for n, f in report["files"].items()},
        "heldout_perplexity": {"dense": ppl["dense_engine"], "gptq4": ppl["gptq4_engine"]},
        "sample": report["sample"],
    }
    by = report["heldout_eval"]["perplexity_by_source"]
    by_source = ", ".join(f"{k} {by['dense_engine'][k]} / {by['gptq4_engine'][k]}"
                          for k in by["dense_engine"] if k != "all")
    runs = ", ".join(f"{r['epochs']} epochs: {r['best_valid_loss']:.4f} (step {r['best_step']} of {r['steps']})"
                     for r in t["runs"])
    body = CARD_RESULT.format(
        parameters=report["model"]["parameters"], shipped_bytes=report["shipped_bytes"],
        chosen_epochs=t["chosen_epochs"], steps=chosen["steps"], tokens_seen=chosen["tokens_seen"],
        best_step=chosen["best_step"], train_seconds=t["seconds_total"], device=t["device"],
        train_docs=c["train_documents"], valid_docs=c["validation_documents"], heldout_docs=c["heldout_documents"],
        train_tokens=c["train_tokens"], ppl_dense=ppl["dense_engine"], ppl_torch=ppl["dense_torch"],
        ppl_gptq=ppl["gptq4_engine"], gptq_delta=report["heldout_eval"]["gptq4_vs_dense"], ppl_rtn=ppl["rtn4_engine"],
        err_gptq=report["quantization_error"]["mean_gptq"], err_rtn=report["quantization_error"]["mean_rtn"],
        eval_tokens=report["heldout_eval"]["tokens"], eval_pieces=report["heldout_eval"]["pieces"], runs=runs,
        by_source=by_source,
        py=report["versions"]["python"], torch=report["versions"]["torch"],
        transformers=report["versions"]["transformers"], sentencepiece=report["versions"]["sentencepiece"],
        corpus_python=c["manifest"]["python"], corpus_rows=corpus_rows, file_rows=file_rows, greedy=greedy_text,
        sample_source=report["sample"]["source"],
        sample_quoted=report["sample"]["text"].replace("\n", "\n> "),
        record=json.dumps(record, indent=2),
    )
    return head + body


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train, quantize and evaluate; write the shipped files and report.json")
    t.add_argument("--corpus", required=True, help="folder written by tools/build_demo_corpus.py")
    t.add_argument("--out", required=True, help="folder for the six shipped files and report.json")
    t.add_argument("--work", help="folder for the dense and RTN checkpoints (default: a temporary folder)")
    t.add_argument("--minutes", type=float, default=4.0,
                   help="training time budget: a run that would not fit is skipped, one that overruns is cut")
    t.add_argument("--tiny", action="store_true", help="tiny model and data settings (CPU smoke test)")
    t.add_argument("--epochs", type=int, nargs="+", help="override the preset's epoch counts to try")
    t.add_argument("--steps", type=int, help="train exactly this many steps per run (overrides epochs)")
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--device", help="training device (default: cuda if available)")
    t.set_defaults(func=cmd_train)
    i = sub.add_parser("install", help="copy a full run's shipped files into the package and write the card")
    i.add_argument("run_dir", help="the --out folder of a train run")
    i.add_argument("--ship-dir", default=str(SHIP_DIR))
    i.add_argument("--card", default=str(CARD))
    i.add_argument("--allow-tiny", action="store_true", help="install a tiny run (tests of this tool only)")
    i.set_defaults(func=cmd_install)
    c = sub.add_parser("card", help="write the card of the model before it is trained")
    c.add_argument("--card", default=str(CARD))
    c.set_defaults(func=cmd_card)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
