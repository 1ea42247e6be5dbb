"""Error types the CLI turns into one clear line (never a bare traceback)."""


class EagleExportError(Exception):
    """Base class: anything the user can fix by changing their input."""


class CheckpointError(EagleExportError):
    """A target or draft checkpoint is missing, malformed, or does not fit."""


class ManifestError(EagleExportError):
    """An artifact directory is incomplete, from another version, or not what the caller expects."""


class GenerationError(EagleExportError):
    """Bad generation request: empty prompt, too long, ids out of range, bad settings."""


class EngineError(EagleExportError):
    """TensorRT is missing, an engine cannot be built or loaded, or a call does not fit the engine's profiles."""
