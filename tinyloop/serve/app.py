"""`create_app`: the OpenAI-compatible HTTP server of `tinyloop serve`, a Starlette app.

Routes: POST /v1/completions and /v1/chat/completions (handler.py does the work), GET
/v1/models, GET /health (503 until the model has loaded, 200 after) and GET /metrics
(Prometheus text). The model is opened on a background thread when the app starts, so the
server answers /health at once; the EngineLoop starts once it is open and stops, with the
model, when the app shuts down. Every error is the OpenAI error body: 400 for a bad request
(the field named), 404 for an unknown path or model, 429 with Retry-After while the engine
holds max_batch + max_queue requests, 503 while loading, 500 if the engine fails. A client
that disconnects cancels its request, streaming or not.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from typing import Any, Optional, Union

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..model import DEFAULT_PREFIX_CACHE_BYTES, Model
from ..scheduler import DEFAULT_MAX_QUEUE
from .engine_loop import EngineLoop
from .handler import Handler, check_servable, served_name
from .metrics import CONTENT_TYPE, ServerMetrics
from .schema import RequestError, parse_json

log = logging.getLogger("tinyloop.serve")
ModelSource = Union[str, "os.PathLike[str]", Model, None]     # what create_app serves
CLIENT_CLOSED_REQUEST = 499       # nginx's status for a request whose client went away


class _Server:
    """The app's state: loading, then a Handler over the open model and its EngineLoop."""

    def __init__(self, model: ModelSource, model_name: Optional[str],
                 model_options: dict[str, Any], engine_options: dict[str, Any]):
        self._source, self._model_name = model, model_name
        self._model_options, self._engine_options = model_options, engine_options
        self.handler: Optional[Handler] = None
        self.failure: Optional[str] = None
        self._engine: Optional[EngineLoop] = None
        self._opened = False              # the model is ours to close
        self._loader: Optional[threading.Thread] = None
        self.metrics = ServerMetrics(lambda: None if self._engine is None else self._engine.stats)

    def load(self) -> None:
        """Open the model and start its engine (the loader thread)."""
        try:
            if isinstance(self._source, Model):
                model, opened = self._source, False
            else:
                model, opened = Model(self._source, **self._model_options), True
            try:
                check_servable(model)
                name = served_name(model, self._model_name)
                engine = EngineLoop(model, **self._engine_options)
            except BaseException:
                if opened:
                    model.close()
                raise
            engine.start()
            self._engine, self._opened = engine, opened
            self.handler = Handler(model, engine, self.metrics, name)
            log.info("serving %s (%s backend)", name, model.backend)
        except Exception as exc:
            self.failure = f"the model failed to load: {exc}"
            log.exception("the model failed to load")

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> Any:
        self._loader = threading.Thread(target=self.load, name="tinyloop-load", daemon=True)
        self._loader.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        if self._loader is not None:
            self._loader.join()
        if self._engine is not None:
            self._engine.stop()
            if self._opened:
                self._engine.model.close()

    def ready(self) -> Handler:
        if self.handler is None:
            raise RequestError(self.failure or "the model is loading; retry shortly", None, 503,
                               "service_unavailable")
        return self.handler


def create_app(model: ModelSource = None, *,
               model_name: Optional[str] = None, max_batch: int = 32, step_tokens: int = 512,
               kv_budget_bytes: int = 0, max_queue: int = DEFAULT_MAX_QUEUE,
               prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
               backend: str = "auto", threads: Optional[int] = None,
               device: str = "auto", kv_mode: Optional[str] = None,
               prefix_cache_dir: Optional[str] = None,
               prefix_cache_disk_bytes: int = 0) -> Starlette:
    """The server of one model: a .tinyloop path (None: the bundled demo model), opened with
    backend/threads/device/kv_mode and the automatic prefix cache of prefix_cache_bytes, backed
    by the disk tier in prefix_cache_dir under prefix_cache_disk_bytes (the model is closed at
    shutdown, so its cached blocks are spilled there and a server restarted on the same
    directory starts warm), or an open Model (the caller keeps owning it; those options are
    then unused). `model_name` is the id
    requests name (default: the model's name, else its file name). max_batch, step_tokens and
    kv_budget_bytes are the Scheduler's; beyond max_batch running, max_queue requests may wait,
    and more are answered 429 with Retry-After."""
    server = _Server(model, model_name,
                     dict(backend=backend, threads=threads, device=device, kv_mode=kv_mode,
                          prefix_cache_bytes=prefix_cache_bytes,
                          prefix_cache_dir=prefix_cache_dir,
                          prefix_cache_disk_bytes=prefix_cache_disk_bytes),
                     dict(max_batch=max_batch, step_tokens=step_tokens,
                          kv_budget_bytes=kv_budget_bytes, max_queue=max_queue))

    async def completions(request: Request) -> Response:
        return await _generate(server, request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _generate(server, request, chat=True)

    async def models(request: Request) -> Response:
        return JSONResponse(server.ready().models())

    async def health(request: Request) -> Response:
        server.ready()
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, lifespan=server.lifespan, exception_handlers=ERROR_HANDLERS)


async def _generate(server: _Server, request: Request, chat: bool) -> Response:
    handler = server.ready()
    body = parse_json(await request.body())
    result = await _unless_disconnected(request, handler.respond(body, chat))
    if result is None:                  # nobody is listening any more
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """`work`'s result, or None when the client disconnects first: `work` is then cancelled,
    and the request in the engine with it. (While a response streams, StreamingResponse
    watches for the disconnect and cancels the stream.)"""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:                 # this handler was cancelled itself
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error(status: int, message: str, kind: str, param: Optional[str] = None,
           code: Optional[str] = None) -> JSONResponse:
    return JSONResponse(RequestError(message, param, status, kind, code).body, status_code=status)


async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    message = (f"no such endpoint: {request.method} {request.url.path}" if exc.status_code == 404
               else f"{request.method} is not allowed on {request.url.path}"
               if exc.status_code == 405 else str(exc.detail))
    return _error(exc.status_code, message, kind,
                  code="unknown_url" if exc.status_code == 404 else None)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("request %s %s failed", request.method, request.url.path, exc_info=exc)
    return _error(500, f"internal server error: {type(exc).__name__}: {exc}", "server_error")


# Starlette's exception_handlers giving every error the OpenAI error body (ray.py's app too).
ERROR_HANDLERS = {RequestError: _request_error, HTTPException: _http_error,
                  Exception: _server_error}
