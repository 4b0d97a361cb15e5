"""Model descriptions, one module per family, registered by config.json `model_type`.

Importing this package registers every family; `lookup(model_type, architectures, where)` returns the
description the loader and the model follow (see base.py and docs/dev/architectures.md).
"""

from kobold_backend.engine.architectures import (  # noqa: F401  (each registers its families)
    cohere,
    deepseek,
    gemma,
    gemma3n,
    gemma4,
    glm,
    gpt_oss,
    llama,
    mistral3,
    moe,
    phi3,
    qwen2,
    qwen3_5,
)
from kobold_backend.engine.architectures.base import (
    Architecture,
    Features,
    LayerLayout,
    Linear,
    RopeSpec,
    lookup,
    register,
    supported_class_names,
    supported_model_types,
)

__all__ = ["Architecture", "Features", "LayerLayout", "Linear", "RopeSpec", "lookup", "register",
           "supported_class_names", "supported_model_types"]
