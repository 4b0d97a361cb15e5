"""kobold_backend: a native Llama-family inference engine for KoboldAI-style frontends."""

__version__ = "0.1.0"
