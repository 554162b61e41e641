"""An OpenAI-compatible HTTP API (FastAPI + uvicorn) in front of a running tritonserver.

It speaks to the serving model over tritonclient's asyncio gRPC streaming, one gRPC stream
per request on one shared channel: `/v1/models`, `/v1/completions`, `/v1/chat/completions`
(the model's chat template from its tokenizer files), `/health/ready`, with an optional API
key. `python -m orca_backend.serving.openai_api --url localhost:8001` runs it alone.
"""
