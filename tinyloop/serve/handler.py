"""The OpenAI endpoints' request handling, independent of the web framework.

`Handler.respond(body, chat)` checks a parsed JSON body (tinyloop.serve.schema), submits the
request to the EngineLoop and returns either the whole response body (a dict) or, for
`stream: true`, an async iterator of server-sent-event lines ending with `data: [DONE]`. The
Starlette app (app.py) and the Ray Serve deployment (ray.py) both serve through it; they only
move bytes and cancel on disconnect (closing the iterator, or cancelling the awaiting task,
cancels the request in the engine).

The reply's text is detokenized incrementally with TextStream (never a broken UTF-8
character) with special tokens dropped; text stop sequences are matched on that text, the
text is cut where the first one starts (it is not included, as in the OpenAI API), the
finish_reason is "stop" and the request is cancelled in the engine. While streaming, text that
might be the start of a stop sequence is held back until it is known not to be one. A request
the engine has no room for (Overloaded) is a 429 with Retry-After: RETRY_AFTER_SECONDS.
"""
from __future__ import annotations

import functools
import json
import os
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional, Union

from ..tokenizer import TextStream
from .engine_loop import EngineLoop, Overloaded, RequestEvents
from .metrics import ServerMetrics
from .schema import GenerationRequest, RequestError, chat_request, check_model, completion_request

RETRY_AFTER_SECONDS = 1     # what a 429 asks a client to wait: a step frees room within that

if TYPE_CHECKING:
    from ..model import Model


class StopText:
    """Finds the first of `stops` in text fed piece by piece; feed() returns the text that is
    safe to show and whether a stop was reached (everything after it is dropped)."""

    def __init__(self, stops: tuple[str, ...]):
        self._stops, self._held = stops, ""

    def feed(self, piece: str, final: bool) -> tuple[str, bool]:
        text, self._held = self._held + piece, ""
        found = [i for i in (text.find(stop) for stop in self._stops) if i >= 0]
        if found:
            return text[:min(found)], True
        if not final:
            keep = max((n for stop in self._stops for n in range(len(stop) - 1, 0, -1)
                        if text.endswith(stop[:n])), default=0)
            text, self._held = text[:len(text) - keep], text[len(text) - keep:]
        return text, False


class Run:
    """One admitted request: its text pieces, then `finish_reason` and `completion_tokens`."""

    def __init__(self, handler: Handler, request: GenerationRequest, events: RequestEvents,
                 arrival: float):
        self.request, self._events, self._arrival = request, events, arrival
        self._metrics, self._decode = handler.metrics, handler.decode
        self.finish_reason: Optional[str] = None
        self.completion_tokens = 0

    async def pieces(self) -> AsyncIterator[str]:
        text = TextStream(self._decode, self.request.prompt_ids)
        stops = StopText(self.request.stop)
        last, ended = self._arrival, "cancelled"
        try:
            async for event in self._events:
                if event.finish == "error":
                    raise RuntimeError("the model produced non-finite logits; the request ended")
                now = time.perf_counter()
                latency = (self._metrics.inter_token_latency if self.completion_tokens
                           else self._metrics.time_to_first_token)
                latency.observe(now - last)
                last = now
                self.completion_tokens += 1
                final = event.finish is not None
                new_text = text.push(event.token) + (text.flush() if final else "")
                piece, stopped = stops.feed(new_text, final)
                if piece:
                    yield piece
                finish = "stop" if stopped else event.finish
                if finish is not None:
                    self.finish_reason = ended = finish
                    return
        except RuntimeError:
            ended = "error"
            raise
        finally:
            self._events.close()         # cancels the request unless it finished
            self._metrics.requests.labels(ended).inc()


def check_servable(model: Model) -> None:
    """The server answers in text: a model without a tokenizer (token ids in, token ids out)
    is refused before it serves, with the reason."""
    if model.config()["tokenizer"] == "none":
        raise ValueError(f"model {model.config()['name'] or model.path!r} has no tokenizer, and the "
                         f"server answers in text: serve a model with one (tinyloop convert keeps a "
                         f"Hugging Face folder's tokenizer.json)")


def served_name(model: Model, given: Optional[str]) -> str:
    """The id a served model answers to: `given`, else the file's model name, else the file's
    name without its extension."""
    return given or model.config()["name"] or os.path.splitext(os.path.basename(model.path))[0]


class Handler:
    """Serves the OpenAI endpoints of one model through one EngineLoop."""

    def __init__(self, model: Model, engine: EngineLoop, metrics: ServerMetrics, model_id: str):
        self.model, self.engine, self.metrics, self.model_id = model, engine, metrics, model_id
        self.decode = functools.partial(model.decode, skip_special_tokens=True)
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_id, "object": "model",
                                            "created": self.created, "owned_by": "tinyloop"}]}

    async def respond(self, body: dict[str, Any], chat: bool
                      ) -> Union[dict[str, Any], AsyncIterator[str]]:
        """The response to a completion (chat=False) or chat completion request: a body, or
        SSE lines for stream: true. RequestError for a request the server refuses."""
        arrival = time.perf_counter()
        check_model(body, self.model_id)
        request = (chat_request if chat else completion_request)(body, self.model)
        try:
            events = await self.engine.submit(request.prompt_ids, **request.sampling)
        except ValueError as exc:           # the Scheduler refused it (e.g. the KV budget)
            raise RequestError(str(exc), request.prompt_field) from None
        except Overloaded as exc:           # as many requests as the engine takes at once
            self.metrics.rejected.inc()
            raise RequestError(str(exc), None, 429, "rate_limit_exceeded", "queue_full",
                               {"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        run = Run(self, request, events, arrival)
        shape = _Shape(chat, self.model_id)
        return self._stream(run, shape) if request.stream else await self._complete(run, shape)

    async def _complete(self, run: Run, shape: _Shape) -> dict[str, Any]:
        try:
            text = "".join([piece async for piece in run.pieces()])
        except RuntimeError as exc:
            raise RequestError(str(exc), None, 500, "server_error") from None
        return shape.response(text, run.finish_reason, _usage(run))

    async def _stream(self, run: Run, shape: _Shape) -> AsyncIterator[str]:
        include_usage = run.request.include_usage
        extra = {"usage": None} if include_usage else {}
        try:
            if shape.chat:
                yield _sse(shape.chunk({"role": "assistant", "content": ""}, None, extra))
            async for piece in run.pieces():
                yield _sse(shape.chunk(piece, None, extra))
            yield _sse(shape.chunk(None, run.finish_reason, extra))
            if include_usage:
                yield _sse(dict(shape.head, choices=[], usage=_usage(run)))
        except RuntimeError as exc:         # the engine failed mid-stream: say so, then end
            yield _sse(RequestError(str(exc), None, 500, "server_error").body)
        yield "data: [DONE]\n\n"


class _Shape:
    """The OpenAI response objects of one request: text_completion or chat.completion."""

    def __init__(self, chat: bool, model_id: str):
        self.chat = chat
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": "chat.completion" if chat else "text_completion",
                     "created": int(time.time()), "model": model_id}

    def response(self, text: str, finish_reason: Optional[str], usage: dict[str, int]
                 ) -> dict[str, Any]:
        choice: dict[str, Any] = (
            {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        return dict(self.head, choices=[dict(index=0, **choice, logprobs=None,
                                             finish_reason=finish_reason)], usage=usage)

    def chunk(self, piece: Any, finish_reason: Optional[str], extra: dict[str, Any]
              ) -> dict[str, Any]:
        """A stream chunk: `piece` is the text (chat: the delta, a dict or text) or None in
        the last chunk, which carries the finish_reason."""
        if self.chat:
            delta = (piece if isinstance(piece, dict) else {} if piece is None
                     else {"content": piece})
            choice: dict[str, Any] = {"delta": delta}
        else:
            choice = {"text": piece or ""}
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return dict(self.head, object=obj, choices=[dict(index=0, **choice, logprobs=None,
                                                         finish_reason=finish_reason)], **extra)


def _usage(run: Run) -> dict[str, int]:
    prompt = len(run.request.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": run.completion_tokens,
            "total_tokens": prompt + run.completion_tokens}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
