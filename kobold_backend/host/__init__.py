"""The KoboldAI United plugin: backend.py (the model_backend class), tokenizer_adapter.py (the tokenizer United
sees), settings.py (saved load settings), shim.py (the class.py written into United) and install.py
(`kobold-backend install-plugin`); United's parameter dicts are the engine's (engine/load_options.py)."""
