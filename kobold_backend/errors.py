"""Exception types shared by the engine, the extension loader and both hosts."""


class KoboldBackendError(Exception):
    """Base class of every error this package raises on purpose."""


class ModelFormatError(KoboldBackendError, ValueError):
    """A model folder this engine cannot run: missing files, wrong shapes, unsupported formats."""


class RequestError(KoboldBackendError, ValueError):
    """A generation request with an invalid field; `field` names it when known."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class ExtensionError(KoboldBackendError, ImportError):
    """The native extension was found but cannot be used here (wrong fingerprint, failed import)."""


class OutOfContextError(KoboldBackendError, ValueError):
    """More tokens than the KV cache was allocated for."""


class PlanError(KoboldBackendError, ValueError):
    """A layer split that cannot work: counts that do not add up, an unknown device, or too little memory."""
