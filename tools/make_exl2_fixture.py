"""Make EXL2 test data with exllamav2's own converter (run on a CUDA machine with exllamav2 installed).

Writes, under OUT:
  source/                 a tiny random-weight fp16 Llama in Hugging Face layout (tests/fixtures/checkpoints.py)
  exl2-<bpw>/             exllamav2's compiled EXL2 folder for each target bits per weight
  exl2-<bpw>/reference.safetensors
                          exllamav2's own dequantization of every linear (`get_weight_tensor_dq()`, stored as
                          [in_features, out_features] fp16 under the module's key + ".dq") and its fp32 logits for
                          PROMPT_IDS under "logits"
  README.md               versions and the exact commands that made the folders

Usage: python tools/make_exl2_fixture.py OUT [BPW ...]   (default BPW: 2.5 4.0 6.0)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPT_IDS = [5, 17, 42, 99, 7, 123, 64, 300, 11, 250, 31, 8]
CONVERT = [sys.executable, "-m", "exllamav2.conversion.convert_exl2"]
CAL = ["-l", "256", "-ml", "256", "-r", "16", "-mr", "8"]


def build_source(out: Path) -> Path:
    from tests.fixtures.checkpoints import CheckpointSpec, build_checkpoint

    spec = CheckpointSpec("source", seed=77, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=64, tokenizer="bpe", vocab_multiple=32)
    return build_checkpoint(spec, out).path


def run(cmd: List[str], log: List[str]) -> None:
    log.append(" ".join(cmd))
    t0 = time.time()
    subprocess.run(cmd, check=True)
    print(f"[{time.time() - t0:.1f}s] {' '.join(cmd)}", flush=True)


def reference(folder: Path) -> None:
    import torch
    from exllamav2 import ExLlamaV2, ExLlamaV2Config
    from exllamav2.linear import ExLlamaV2Linear
    from safetensors.torch import save_file

    config = ExLlamaV2Config(str(folder))
    model = ExLlamaV2(config)
    model.load()
    tensors = {}
    for module in model.modules:
        for sub in [module, *getattr(module, "submodules", [])]:
            if isinstance(sub, ExLlamaV2Linear):
                tensors[sub.key + ".dq"] = sub.get_weight_tensor_dq().detach().to("cpu", torch.float16).contiguous()
    ids = torch.tensor([PROMPT_IDS], dtype=torch.long)
    with torch.inference_mode():
        logits = model.forward(ids)
    tensors["logits"] = logits.float().cpu().contiguous()
    save_file(tensors, str(folder / "reference.safetensors"))
    print(f"{folder.name}: {len(tensors) - 1} linears dequantized, logits {tuple(tensors['logits'].shape)}")


def main(argv: List[str]) -> int:
    out = Path(argv[0]).resolve()
    bpws = argv[1:] or ["2.5", "4.0", "6.0"]
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    log: List[str] = ["python tools/make_exl2_fixture.py " + " ".join(argv)]
    source = build_source(out)
    measurement = out / "work-measure" / "measurement.json"
    run([*CONVERT, "-i", str(source), "-o", str(out / "work-measure"), *CAL, "-om", str(measurement)], log)
    for bpw in bpws:
        work = out / f"work-{bpw}"
        dest = out / f"exl2-{bpw}"
        head = "8" if float(bpw) >= 6 else "6"
        run([*CONVERT, "-i", str(source), "-o", str(work), "-cf", str(dest), "-b", bpw, "-hb", head,
             "-m", str(measurement), *CAL], log)
        shutil.rmtree(work)
        reference(dest)
    shutil.rmtree(out / "work-measure")
    import exllamav2
    import torch

    versions = {"exllamav2": exllamav2.__version__, "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0), "python": sys.version.split()[0]}
    text = ["# EXL2 fixtures made by exllamav2's converter", "", "Versions: " + json.dumps(versions), "",
            "Commands (paths relative to the output folder's parent):", ""]
    text += [f"    {c.replace(str(out.parent) + '/', '')}" for c in log]
    text += ["", f"reference.safetensors: exllamav2's get_weight_tensor_dq() per linear ([in, out] fp16, key + "
             f"'.dq') and model.forward logits (fp32) for prompt ids {PROMPT_IDS}.", ""]
    (out / "README.md").write_text("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
