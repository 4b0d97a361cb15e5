"""exllamav2's own logits for tests/data/exl2 (run on a CUDA machine with exllamav2 installed).

For each fixture folder: the prompt prefilled through an ExLlamaV2Cache (causal; exllamav2's forward without a
cache attends to the whole input, which is why tools/make_exl2_fixture.py's logits are not used), then the last
prompt token decoded alone. Writes tests/data/exl2/reference-logits.safetensors: per bpw "<bpw>" the [1, T, V] fp32
logits (prefill of the first T - 1 tokens, then the decode step of the last).

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
    cache = ExLlamaV2Cache(model, max_seq_len=256, lazy=True)
    model.load_autosplit(cache)
    with torch.inference_mode():
        prefill = model.forward(ids[:, :-1], cache, last_id_only=False).float().cpu()
        step = model.forward(ids[:, -1:], cache).float().cpu()
    model.unload()
    return torch.cat([prefill, step[:, -1:]], dim=1).contiguous()


def main(argv: list) -> int:
    out = Path(argv[0]) if argv else DATA / "reference-logits.safetensors"
    ids = torch.tensor([json.loads((DATA / "reference.json").read_text())["prompt_ids"]])
    tensors = {}
    for folder in sorted(DATA.glob("exl2-*")):
        tensors[folder.name[len("exl2-"):]] = logits_for(folder, ids)
        print(folder.name, tuple(tensors[folder.name[len("exl2-"):]].shape), flush=True)
    save_file(tensors, str(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
