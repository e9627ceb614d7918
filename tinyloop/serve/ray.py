"""Scale-out on Ray Serve: N engine replicas behind prefix-affinity routing (docs/serving.md).

Needs the `ray` extra (pip install 'tinyloop[ray]'). `deploy(model_path, num_replicas=2)` runs
a Serve application of `num_replicas` `Replica`s, each with its own Model (automatic prefix
cache on), EngineLoop and Handler, and returns their DeploymentHandle:

    handle.options(stream=True).generate.remote(prompt_ids, **sampling)
        streams (token, finish) pairs: Scheduler.add's arguments in, its events out, so the
        tokens equal Model.generate's for the same arguments on whichever replica runs it;
    handle.options(stream=True).respond.remote(body, chat)
        the OpenAI handling of `tinyloop serve` (handler.py): first (status, payload,
        headers), the response body or error body and its headers (a 429's Retry-After); for
        `stream: true` (200, None, {}) and then the SSE lines;
    handle.broadcast("cache_stats").results()
        every replica's Model.cache_stats().

With `route_prefix` the application also gets an HTTP ingress (`Ingress`) that serves
POST /v1/completions, /v1/chat/completions, GET /v1/models and /health on Serve's proxy.

Routing is a Ray Serve request router, chosen per deployment: "prefix" is `PrefixAffinityRouter`
(below); "round_robin" is Ray's RoundRobinRouter, the baseline. Ray's own
`ray.serve.llm.request_router.PrefixCacheAffinityRouter` is not used: `ray.serve.llm` needs the
`ray[llm]` extra (vLLM), and it matches prompt text against a tree in a detached actor that it
queries with blocking calls on every request.
"""
from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import Any, AsyncIterator, Optional

import numpy as np
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..model import Model
from .app import ERROR_HANDLERS
from .engine_loop import EngineLoop
from .handler import Handler, check_servable, served_name
from .metrics import ServerMetrics
from .schema import RequestError, parse_json

REPLICA = "TinyLoopReplica"       # the engine deployment's name in the application
INGRESS = "TinyLoopIngress"
ROUTERS = {"prefix": "tinyloop.serve.ray:PrefixAffinityRouter",
           "round_robin": "ray.serve.experimental.round_robin_router:RoundRobinRouter"}


class PrefixAffinityRouter(RequestRouter):
    """Sends each request to the replica it last sent the longest prefix of its prompt to.

    A prompt is cut into blocks: `block_size` token ids (a `generate` call, the KV block of the
    replicas' prefix cache) or 4 * block_size bytes of UTF-8 text (a `respond` call: the
    completion prompt, or the chat messages' roles and contents). Block i's key is a hash of
    block i and key i-1, the first keyed by the request's cache_salt: equal keys mean equal
    prefixes the replica may share. The router remembers the replica each key was last routed
    to (the `max_keys` most recently used) and prefers the one holding the longest known prefix;
    when that replica is full (max_ongoing_requests), or the prompt starts with nothing known,
    the least-loaded replica gets it. The memory is this router's (each handle has one): with
    several callers a prefix may be cached on up to one replica per caller.
    """

    # Serve calls it with the deployment's request_router_kwargs
    def initialize_state(self, block_size: int = 16,  # type: ignore[override]
                         max_keys: int = 1 << 16) -> None:
        self._block_size, self._max_keys = block_size, max_keys
        self._homes: OrderedDict[bytes, ReplicaID] = OrderedDict()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # back off between rounds when every replica is full instead of spinning
            pending_request.routing_context.should_backoff = True
        home = self._home(pending_request, candidate_replicas)
        if home is None:
            return [candidate_replicas]
        return [[home], [replica for replica in candidate_replicas if replica is not home]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        for key in self._keys(pending_request):
            self._homes[key] = replica_id
            self._homes.move_to_end(key)
        while len(self._homes) > self._max_keys:
            self._homes.popitem(last=False)

    def _home(self, pending_request: Optional[PendingRequest],
              candidates: list[RunningReplica]) -> Optional[RunningReplica]:
        by_id = {replica.replica_id: replica for replica in candidates}
        for key in reversed(self._keys(pending_request)):
            if key in self._homes:
                return by_id.get(self._homes[key])   # None: that replica is gone
        return None

    def _keys(self, pending_request: Optional[PendingRequest]) -> list[bytes]:
        prompt = None if pending_request is None else _prompt_bytes(pending_request)
        return [] if prompt is None else block_keys(*prompt, block_bytes=4 * self._block_size)


def block_keys(kind: bytes, data: bytes, salt: str, block_bytes: int) -> list[bytes]:
    """The keys of the full blocks of `block_bytes` of a prompt's `data` (int32 token ids or
    UTF-8 text, `kind` b"ids" or b"text"): key i hashes block i and key i-1; the first starts
    from the kind and the cache salt."""
    key = hashlib.blake2b(kind + b"\0" + salt.encode(), digest_size=16).digest()
    keys = []
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        key = hashlib.blake2b(key + data[start:start + block_bytes], digest_size=16).digest()
        keys.append(key)
    return keys


def _prompt_bytes(pending_request: PendingRequest) -> Optional[tuple[bytes, bytes, str]]:
    """(kind, prompt bytes, cache_salt) of a generate or respond call; None for other calls
    and for prompts that are not well formed (the replica then answers with the error)."""
    args, kwargs = pending_request.args, pending_request.kwargs
    method = pending_request.metadata.call_method
    try:
        if method == "generate":
            ids = np.asarray(args[0] if args else kwargs["prompt_ids"])
            return b"ids", ids.astype("<i4").tobytes(), str(kwargs.get("cache_salt") or "")
        if method == "respond":
            body = args[0] if args else kwargs["body"]
            salt = str(body.get("cache_salt") or "")
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return b"text", prompt.encode(), salt
            if isinstance(prompt, list):
                return b"ids", np.asarray(prompt).astype("<i4").tobytes(), salt
            messages = body.get("messages")
            if isinstance(messages, list):
                text = "".join(f"{m.get('role')}\n{m.get('content')}\n" for m in messages)
                return b"text", text.encode(), salt
    except (IndexError, KeyError, TypeError, ValueError, AttributeError, OverflowError):
        pass
    return None


class Replica:
    """One engine of the deployment: a Model, its EngineLoop and the server's Handler."""

    def __init__(self, model_path: Optional[str], model_options: dict[str, Any],
                 engine_options: dict[str, Any], model_name: Optional[str]):
        self.model = Model(model_path, **model_options)
        check_servable(self.model)
        self.engine = EngineLoop(self.model, **engine_options)
        self.engine.start()
        self.handler = Handler(self.model, self.engine, ServerMetrics(lambda: self.engine.stats),
                               served_name(self.model, model_name))

    async def generate(self, prompt_ids: Any, **sampling: Any
                       ) -> AsyncIterator[tuple[int, Optional[str]]]:
        async for event in self.engine.generate(prompt_ids, **sampling):
            yield event.token, event.finish

    async def respond(self, body: dict[str, Any], chat: bool = False) -> AsyncIterator[Any]:
        try:
            reply = await self.handler.respond(body, chat)
        except RequestError as exc:
            yield exc.status, exc.body, exc.headers
            return
        if isinstance(reply, dict):
            yield 200, reply, {}
            return
        yield 200, None, {}
        async for line in reply:
            yield line

    def models(self) -> dict[str, Any]:
        return self.handler.models()

    def cache_stats(self) -> dict[str, int]:
        return self.model.cache_stats()

    def __del__(self) -> None:
        # Serve calls it when the replica shuts down, the garbage collector again later
        if hasattr(self, "engine") and not self.model.closed:
            self.engine.stop()
            self.model.close()


class Ingress:
    """The HTTP front of the application: OpenAI bodies go to the replicas' `respond`, whose
    router picks the replica; a client that disconnects cancels its request there."""

    def __init__(self, replicas: DeploymentHandle[Any]):
        self.replicas = replicas.options(stream=True)

    def __serve_build_asgi_app__(self) -> Starlette:
        async def completions(request: Request) -> Response:
            return await self._respond(request, chat=False)

        async def chat_completions(request: Request) -> Response:
            return await self._respond(request, chat=True)

        async def models(request: Request) -> Response:
            return JSONResponse(await self.replicas.options(stream=False).models.remote())

        async def health(request: Request) -> Response:
            return JSONResponse({"status": "ok"})

        routes = [Route("/v1/completions", completions, methods=["POST"]),
                  Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                  Route("/v1/models", models, methods=["GET"]),
                  Route("/health", health, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers=ERROR_HANDLERS)

    async def _respond(self, request: Request, chat: bool) -> Response:
        body = parse_json(await request.body())
        reply: Any = self.replicas.respond.remote(body, chat)     # streamed
        try:
            status, payload, headers = await reply.__anext__()
        except BaseException:             # this request was cancelled (the client went away)
            reply.cancel()
            raise
        if payload is not None:
            return JSONResponse(payload, status_code=status, headers=headers)
        return StreamingResponse(_lines(reply), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


async def _lines(reply: Any) -> AsyncIterator[str]:
    """The SSE lines of a streamed reply; ending early (a disconnect) cancels the request."""
    try:
        async for line in reply:
            yield line
    finally:
        reply.cancel()


def deploy(model_path: Optional[str | os.PathLike[str]] = None, num_replicas: int = 2,
           routing: str = "prefix", *, name: str = "tinyloop", route_prefix: Optional[str] = None,
           model_name: Optional[str] = None, model_options: Optional[dict[str, Any]] = None,
           engine_options: Optional[dict[str, Any]] = None,
           max_ongoing_requests: Optional[int] = None,
           ray_actor_options: Optional[dict[str, Any]] = None) -> DeploymentHandle[Any]:
    """Run application `name`: `num_replicas` Replicas of the model at `model_path` (None: the
    bundled demo model) and, with `route_prefix` (e.g. "/"), the HTTP Ingress there; returns
    the replicas' handle once every replica is ready.

    model_options are Model's (backend, threads, block_size, prefix_cache_bytes, ...),
    engine_options EngineLoop's (max_batch, step_tokens, kv_budget_bytes, max_queue). routing: "prefix"
    or "round_robin". A replica takes at most `max_ongoing_requests` requests at once (default
    the engine's max_batch, 32); beyond that the router sends a request elsewhere or queues it.
    ray_actor_options are each replica's Ray resources (default {"num_cpus": threads or 1}).
    Ray starts or connects as `serve.run` does (ray.init beforehand picks the cluster; serve.start
    beforehand picks the proxy's host and port).
    """
    if routing not in ROUTERS:
        raise ValueError(f"routing must be one of {sorted(ROUTERS)}, got {routing!r}")
    model_options = dict(model_options or {})
    engine_options = dict(engine_options or {})
    path = None if model_path is None else os.fspath(model_path)
    router = dict(request_router_class=ROUTERS[routing],
                  request_router_kwargs=({"block_size": model_options.get("block_size", 16)}
                                         if routing == "prefix" else {}))
    replicas = serve.deployment(
        name=REPLICA, num_replicas=num_replicas,
        max_ongoing_requests=max_ongoing_requests or engine_options.get("max_batch", 32),
        ray_actor_options=ray_actor_options or {"num_cpus": model_options.get("threads") or 1},
        request_router_config=router,
    )(Replica).bind(path, model_options, engine_options, model_name)
    if route_prefix is None:
        serve.run(replicas, name=name, route_prefix=None)
    else:
        ingress = serve.deployment(name=INGRESS, ray_actor_options={"num_cpus": 0})(
            serve.ingress()(Ingress))
        serve.run(ingress.bind(replicas), name=name, route_prefix=route_prefix)
    return serve.get_deployment_handle(REPLICA, app_name=name)
