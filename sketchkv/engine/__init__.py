"""The engine: one request's sequence (sequence.py), who runs each step (scheduler.py), a step on the device
(model_runner.py: caches, CUDA graphs), the loop that ties them together (llm_engine.py), MTP speculative decoding
(speculative.py), per-step metadata for the layers (context.py), incremental detokenization and phase timing."""
