"""OpenAI-compatible HTTP server (`sketchkv serve`): app.py (FastAPI), engine_thread.py, replica.py + router.py
(data-parallel replicas). Import the modules themselves: this package imports nothing, so the replica and
router code stay usable where FastAPI is not installed (e.g. `sketchkv bench agents --data-parallel`)."""
