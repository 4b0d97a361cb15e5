"""Sampler families behind engine.sampling: truncation, temperature, penalties, DRY, XTC and mirostat."""
