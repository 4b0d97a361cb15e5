"""The test suite (a package so that `tests.fixtures` and `kobold_backend` import from the repository root)."""
