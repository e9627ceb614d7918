"""`tinyloop serve`: an OpenAI-compatible HTTP server with continuous batching (docs/serving.md).

Needs the `serve` extra (pip install 'tinyloop[serve]': starlette, uvicorn, prometheus-client).
`create_app` builds the Starlette app; `EngineLoop` runs a model's Scheduler on its own thread
for asyncio callers; `Handler` is the request handling both app.py and ray.py serve through.
"""
from .app import create_app
from .engine_loop import EngineLoop
from .handler import Handler

__all__ = ["EngineLoop", "Handler", "create_app"]
