"""OpenAI-compatible HTTP server (`sketchkv serve`)."""
from sketchkv.server.app import DEFAULT_MAX_REQUEST_BYTES, create_app

__all__ = ["create_app", "DEFAULT_MAX_REQUEST_BYTES"]
