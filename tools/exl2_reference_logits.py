"""exllamav2's own logits for tests/data/exl2 (run on a CUDA machine with exllamav2 installed).

For each fixture folder: the prompt prefilled through an ExLlamaV2Cache (causal; exllamav2's forward without a
cache attends to the whole input, so the logits tools/make_exl2_fixture.py saved are not causal ones), then the
last prompt token decoded alone. Writes OUT_FILE (default tests/data/exl2/reference-logits-causal.safetensors):
per bpw "<bpw>" the [1, T, V] fp32 logits (prefill of the first T - 1 tokens, then the decode step of the last).
Not yet run successfully: its first run used load_autosplit, which failed on this model.

Usage: python tools/exl2_reference_logits.py [OUT_FILE]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "exl2"


def logits_for(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config

    model = ExLlamaV2(ExLlamaV2Config(str(folder)))
    model.load()  # load_autosplit's trial forward fails on this tiny shape in exllamav2 0.3.2 (attn.py view)
    cache = ExLlamaV2Cache(model, max_seq_len=256)
    with torch.inference_mode():
        prefill = model.forward(ids[:, :-1], cache, last_id_only=False).float().cpu()
        step = model.forward(ids[:, -1:], cache).float().cpu()
    model.unload()
    return torch.cat([prefill, step[:, -1:]], dim=1).contiguous()


def main(argv: list) -> int:
    out = Path(argv[0]) if argv else DATA / "reference-logits-causal.safetensors"
    ids = torch.tensor([json.loads((DATA / "reference.json").read_text())["prompt_ids"]])
    tensors = {}
    for folder in sorted(DATA.glob("exl2-*")):
        tensors[folder.name[len("exl2-"):]] = logits_for(folder, ids)
        print(folder.name, tuple(tensors[folder.name[len("exl2-"):]].shape), flush=True)
    save_file(tensors, str(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
