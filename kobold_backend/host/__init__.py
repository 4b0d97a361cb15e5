"""The KoboldAI United plugin: backend.py (the model_backend class), tokenizer_adapter.py (the tokenizer United
sees), parameters.py (United's parameter dicts, also used by the server's page), settings.py (saved load
settings), shim.py (the class.py written into United) and install.py (`kobold-backend install-plugin`)."""
