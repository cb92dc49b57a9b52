"""Serving: an OpenAI-compatible HTTP server over continuous batching in fixed slots.

  scheduler.py  the engine thread: a FIFO queue in front of `decoding.slots.SlotEngine`, rounds
                back to back while a slot is busy, cancellation, draining
  api.py        the FastAPI front end: /v1/completions, /v1/chat/completions (SSE streaming),
                /v1/models, /health, /metrics (Prometheus)

`python -m eagle3_jax serve` (eagle3_jax/cli/serve.py) loads a target and head and runs it under
uvicorn; docs/serving.md says what is served and what is not yet.
"""
