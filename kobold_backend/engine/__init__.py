"""The engine room: model configuration, architectures, weight formats, the model and its cache, tokenizers,
sampling, requests and the generator every host calls (docs/architecture.md lists each module)."""
