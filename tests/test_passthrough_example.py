"""The worked example of docs/passthrough.md, run for real on the fixture model: derive a steering vector from
positive and negative prompts with `capture` (mean difference of last-token states), save it as a control
vector, then `steer` with it. transformers (hidden_states, a forward hook) is the oracle of each step."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import List

import numpy as np
import torch
from safetensors.torch import save_file

from kobold_backend.engine.generator import GenerationRequest, Generator
from kobold_backend.engine.loader import load_model
from kobold_backend.engine.passthrough import PassthroughConfig, build_passthrough
from kobold_backend.engine.sampling import SamplerSettings
from tests.fixtures.checkpoints import CheckpointFactory
from tests.fixtures.hf_oracle import hf_load, row_rel_err
from tests.test_passthrough import HFSteering, hf_greedy

POSITIVE = ["I love this, it is wonderful", "What a happy and bright day"]
NEGATIVE = ["I hate this, it is terrible", "What a sad and gloomy day"]
LAYER = 0


def test_derive_a_vector_with_capture_then_steer(checkpoints: CheckpointFactory, tmp_path: Path) -> None:
    built = checkpoints.get("dense_fp32")
    (tmp_path / "vectors").mkdir()

    # --- the example, as in docs/passthrough.md ---
    lm = load_model(built.path, device="cpu")
    gen = Generator(lm.model, lm.tokenizer)
    config = PassthroughConfig(vectors_dir=tmp_path / "vectors")

    def last_state(text: str) -> np.ndarray:
        spec = {"capture": {"layers": [LAYER], "positions": "last", "dtype": "float32"}}
        pt = build_passthrough(spec, lm.model, config)
        ids = lm.tokenizer.encode(text, add_bos=True)
        gen.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=1, passthrough=pt))
        entry = pt.results()["capture"]["prompt"][str(LAYER)]
        data = np.frombuffer(base64.b64decode(entry["data"]), dtype="<f4").reshape(entry["shape"])
        return data[0, -1]

    direction = np.mean([last_state(t) for t in POSITIVE], 0) - np.mean([last_state(t) for t in NEGATIVE], 0)
    save_file({f"direction.{LAYER}": torch.from_numpy(direction.copy())}, str(tmp_path / "vectors" / "joy.safetensors"))

    neutral = lm.tokenizer.encode("The weather today is", add_bos=True)
    steer = build_passthrough({"steer": {"vector": "joy", "strength": 4.0}}, lm.model, config)
    steered = gen.generate(GenerationRequest(prompt_ids=neutral, max_new_tokens=12,
                                             settings=SamplerSettings(top_k=1), passthrough=steer)).token_ids
    # --- end of the example ---

    hf = hf_load(built.oracle_path)

    def hf_last_state(text: str) -> torch.Tensor:
        ids = torch.tensor([lm.tokenizer.encode(text, add_bos=True)])
        with torch.no_grad():
            return hf(ids, output_hidden_states=True).hidden_states[LAYER + 1][0, -1]

    expected: torch.Tensor = (torch.stack([hf_last_state(t) for t in POSITIVE]).mean(0)
                              - torch.stack([hf_last_state(t) for t in NEGATIVE]).mean(0))
    assert float(expected.norm()) > 1.0
    assert row_rel_err(torch.from_numpy(direction), expected) < 1e-4

    prompt = torch.tensor([neutral])
    with HFSteering(hf, {LAYER: 4.0 * expected}):
        reference: List[int] = hf_greedy(hf, prompt, 12)
    assert steered == reference
    assert steered != hf_greedy(hf, prompt, 12)
