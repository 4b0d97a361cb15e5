"""GGUF files (llama.cpp / KoboldCpp): metadata -> config, vocabulary -> tokenizer files, tensors -> weights.

A GGUF model is presented to the rest of the engine as the Hugging Face folder it was converted from: the config
dict `config.json` would hold, the tokenizer files, and weights under their Hugging Face names (quantized linears
as `GGMLWeight`s kept in their block format), so every architecture description works on GGUF unchanged.
"""
