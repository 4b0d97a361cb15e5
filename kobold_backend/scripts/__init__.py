"""Programs run by path in another Python (the host's or the target's): standard library only, no imports from
kobold_backend, so they work before this package or its dependencies are installed there."""
