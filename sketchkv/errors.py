"""Errors that reach users as one clear line (the CLI prints them without a traceback)."""


class SketchKVError(Exception):
    """Base class: a problem with the user's input, not a bug."""


class CheckpointError(SketchKVError):
    """A model directory that cannot be loaded: missing/corrupt file, bad config, missing or misshapen tensor."""


class RequestError(SketchKVError):
    """A request that cannot be served as given (too long, bad sampling parameters, ...)."""


class CapacityError(SketchKVError):
    """A request that does not fit the configured GPU or host memory budget."""
