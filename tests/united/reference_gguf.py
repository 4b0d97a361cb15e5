"""Writes GGUF files of two tiny Llama checkpoints with this Python's `gguf` (the newest: the project's own .venv),
as test_gguf_model.py does (a sentencepiece vocabulary with the legacy block formats Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/F16,
and a Llama 3 byte-level BPE vocabulary in Q8_0), with transformers' float32 logits and greedy tokens on the
dequantized weights and AutoTokenizer's ids: OUT/<name>/model.gguf and OUT/<name>/reference.safetensors +
reference.json. tests/test_gguf_versions.py reads them under United's gguf/numpy/torch. Usage: python ... OUT"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.gguf_files import write_gguf
from tests.fixtures.hf_oracle import hf_load, hf_step
from tests.test_gguf_model import BPE_SPEC, PLANS, SPM_SPEC, TEXTS

PROMPT = [1, 15, 300, 7, 42, 99, 5, 250, 17, 3]
CASES = {"spm": (SPM_SPEC, PLANS["legacy"]), "bpe": (BPE_SPEC, {"*": "Q8_0"})}
GREEDY_TOKENS = 16


def main(out: Path) -> None:
    for name, (spec, plan) in CASES.items():
        hf_folder = build_checkpoint(spec, out / "hf").path
        oracle = write_gguf(hf_folder, out / name, plan)
        model = hf_load(oracle)
        ids = torch.tensor([PROMPT])
        logits, past = hf_step(model, ids, None)
        full = logits[0].clone()
        tokens = []
        for _ in range(GREEDY_TOKENS):
            tokens.append(int(logits[0, -1].argmax()))
            logits, past = hf_step(model, torch.tensor([[tokens[-1]]]), past)
        save_file({"logits": full.contiguous()}, str(out / name / "reference.safetensors"))
        record = {"prompt": PROMPT, "greedy": tokens}
        if name == "bpe":
            hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
            texts = TEXTS + ["<|begin_of_text|>after a special token", "x<|eot_id|>y"]
            record["texts"] = {t: hf_tok.encode(t, add_special_tokens=False) for t in texts}
        (out / name / "reference.json").write_text(json.dumps(record), encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
