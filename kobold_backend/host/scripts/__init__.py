"""Programs install-plugin runs by path in the KoboldAI host's Python, from United's folder: standard library
only (pip's vendored packaging where noted), Python 3.8+, no imports from kobold_backend before it is installed
there. Each puts the working folder first on sys.path, as `python -c` would."""
