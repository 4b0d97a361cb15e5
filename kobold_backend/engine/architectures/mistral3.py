"""Mistral Small 3.x (`mistral3`, Mistral3ForConditionalGeneration): the text model of the multimodal checkpoint.

config.json holds the decoder's settings under `text_config` (a Mistral config, head_dim independent of hidden /
heads); the decoder's tensors are stored under `language_model.` (`language_model.model.layers.N...`,
`language_model.lm_head`; transformers >= 4.52 writes `model.language_model.layers.N...` and `lm_head`). The vision
tower and the projector (`vision_tower.`, `multi_modal_projector.`) are not loaded: this engine runs text only.
"""

from __future__ import annotations

from typing import Any, Dict, List

from kobold_backend.engine.architectures.base import register
from kobold_backend.engine.architectures.llama import Mistral
from kobold_backend.errors import ModelFormatError

_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
             ("language_model.lm_head.", "lm_head."))


class Mistral3(Mistral):
    model_types = ("mistral3",)
    class_names = ("Mistral3ForConditionalGeneration",)

    def text_config(self, raw: Dict[str, Any], where: str) -> Dict[str, Any]:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelFormatError(f"{where}: a mistral3 config.json must hold the text model's settings in "
                                   "text_config.")
        merged = dict(text, model_type=raw["model_type"], architectures=raw.get("architectures") or [])
        for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "quantization_config", "torch_dtype",
                    "dtype"):
            if raw.get(key) is not None:
                merged[key] = raw[key]
        return merged

    def stored_names(self, names: List[str]) -> Dict[str, str]:
        out = {}
        for name in names:
            for stored, engine in _PREFIXES:
                if name.startswith(stored):
                    out[engine + name[len(stored):]] = name
        return out


register(Mistral3())
