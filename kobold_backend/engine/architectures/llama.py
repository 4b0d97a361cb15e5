"""Llama 1/2/3 (the base layout) and Mistral (incl. Nemo's independent head_dim), whose `sliding_window`
applies to every layer."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict

from kobold_backend.engine.architectures.base import Architecture, Features, register, uniform_windows
from kobold_backend.engine.config_types import ConfigData


class Llama(Architecture):
    model_types = ("llama",)
    class_names = ("LlamaForCausalLM",)


class Mistral(Architecture):
    model_types = ("mistral",)
    class_names = ("MistralForCausalLM",)

    def features(self, raw: Dict[str, Any], config: ConfigData, where: str) -> Features:
        return replace(super().features(raw, config, where), windows=uniform_windows(raw, config, where))


register(Llama())
register(Mistral())
