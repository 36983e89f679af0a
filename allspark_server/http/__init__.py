"""allspark-serve: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an Engine or a pool.

A client of the public API like any user (docs/architecture.md): it owns HTTP, detokenization, admission and metrics,
never engine state. cli.py (flags, uvicorn), backend.py (the engine), app.py (routes), body.py (reading a body),
protocol.py (validation), serving.py (one request's flow), responses.py (bodies), detokenize.py, stream.py
(queues -> asyncio), admission.py, metrics.py.
"""
