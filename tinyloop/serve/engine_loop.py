"""`EngineLoop`: a Model's Scheduler stepping on its own thread, fed from asyncio.

The Scheduler is not thread-safe, so one thread (the engine thread) owns it: it applies the
adds and cancels that asyncio callers queued, runs `step()` while there is work (the native
backend releases the GIL there) and sleeps on a condition when there is none. Each event goes
to its request's asyncio queue through `loop.call_soon_threadsafe`, so callers on any event
loop only ever await. An exception never ends the thread: a refused add fails that request
(the Scheduler's ValueError reaches the caller as is); a step out of memory is retried (a
retried step loses no token, and requests finishing or cancelled meanwhile free memory), and
only after OUT_OF_MEMORY_RETRIES failures in a row, or on any other error, does a failed step
fail the requests it was running, which are cancelled, while later requests are served as
before. The requests it holds at once (running and waiting) are bounded: max_batch +
max_queue; `submit` beyond that raises Overloaded at once, so a flood of clients costs no
memory beyond that bound (the server answers 429 with Retry-After).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from .. import params as P
from ..scheduler import DEFAULT_MAX_QUEUE, Scheduler, SchedulerEvent

if TYPE_CHECKING:
    from ..model import Model

log = logging.getLogger("tinyloop.serve")
OUT_OF_MEMORY_RETRIES = 50       # consecutive steps out of memory before the requests fail
OUT_OF_MEMORY_PAUSE = 0.02       # seconds between them


class Overloaded(Exception):
    """The engine holds max_batch + max_queue requests already: retry later."""


class _Request:
    """One request as both threads see it: the asyncio side's queue and loop, and the id the
    Scheduler gave it (set by the engine thread; None until added or when refused)."""

    __slots__ = ("loop", "queue", "rid")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.rid: Optional[int] = None


class RequestEvents:
    """The events of one admitted request, as an async iterator ending after the finish event;
    an engine failure raises from it. close() before the end (a client that went away)
    cancels the request: its owner must call it."""

    def __init__(self, engine: EngineLoop, request: _Request):
        self._engine, self._request, self._done = engine, request, False

    def __aiter__(self) -> RequestEvents:
        return self

    async def __anext__(self) -> SchedulerEvent:
        if self._done:
            raise StopAsyncIteration
        item = await self._request.queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        event: SchedulerEvent = item
        if event.finish is not None:
            self._done = True
        return event

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._engine._post("cancel", self._request)


class EngineLoop:
    """Owns a Model's Scheduler on its own thread; asyncio callers submit requests.

    `stats` is the latest snapshot, taken by the engine thread after it applies the queued
    adds and cancels and after every step: the Scheduler's stats() plus the model's
    prefix-cache counters under "cache". The engine holds at most max_batch + max_queue
    requests at once: a request counts from its submit until it leaves the engine (refused,
    finished, cancelled or failed), whether or not its caller still reads its events."""

    def __init__(self, model: Model, *, max_batch: int = 32, step_tokens: int = 512,
                 kv_budget_bytes: int = 0, max_queue: int = DEFAULT_MAX_QUEUE):
        max_queue = P.check_int("max_queue", max_queue, 0)
        self.model = model
        self._scheduler = Scheduler(model, max_batch=max_batch, step_tokens=step_tokens,
                                    kv_budget_bytes=kv_budget_bytes)
        self.max_requests = max_batch + max_queue
        self._held = 0                    # requests submitted, not yet out of the engine (_wake)
        self._wake = threading.Condition()
        self._commands: collections.deque[tuple[str, _Request, tuple[Any, ...]]] = (
            collections.deque())
        self._running: dict[int, _Request] = {}     # engine thread only
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self.stats: dict[str, Any] = self._snapshot()

    # -- lifetime (the owner's thread) -------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tinyloop-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (requests still queued or running fail) and close the Scheduler."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        self._scheduler.close()

    # -- the asyncio side ---------------------------------------------------------------------
    async def submit(self, prompt_ids: Any, **gen_kwargs: Any) -> RequestEvents:
        """Add a request (Scheduler.add's arguments); returns its events once it is admitted.
        Raises Overloaded when max_batch + max_queue requests are already held, and what
        Scheduler.add raises (ValueError for a request it refuses)."""
        with self._wake:
            if self._held >= self.max_requests:
                raise Overloaded(f"the server holds {self._held} requests, as many as it takes at "
                                 f"once (max_batch + max_queue = {self.max_requests}); retry later")
            self._held += 1
        request = _Request(asyncio.get_running_loop())
        if not self._post("add", request, (prompt_ids, gen_kwargs)):
            self._release()
            raise RuntimeError("the server is shutting down")
        try:
            admitted = await request.queue.get()
        except BaseException:             # the caller was cancelled while it waited
            self._post("cancel", request)
            raise
        if isinstance(admitted, BaseException):
            raise admitted
        return RequestEvents(self, request)

    def _release(self) -> None:
        """A request left the engine (or never reached it)."""
        with self._wake:
            self._held -= 1

    async def generate(self, prompt_ids: Any, **gen_kwargs: Any) -> AsyncIterator[SchedulerEvent]:
        """Yields each SchedulerEvent of the request; closing the iterator cancels it."""
        events = await self.submit(prompt_ids, **gen_kwargs)
        try:
            async for event in events:
                yield event
        finally:
            events.close()

    def _post(self, command: str, request: _Request, args: tuple[Any, ...] = ()) -> bool:
        """Queue a command for the engine thread; False once it is stopping (it then fails
        every request it still has, so a cancel is not needed)."""
        with self._wake:
            if self._stopping:
                return False
            self._commands.append((command, request, args))
            self._wake.notify()
            return True

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        out_of_memory = 0                 # steps in a row that ran out of memory
        while True:
            with self._wake:
                if out_of_memory:         # let finishing or cancelled requests free memory
                    self._wake.wait(OUT_OF_MEMORY_PAUSE)
                while not (self._commands or self._stopping or self._running):
                    self._wake.wait()
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            try:
                for command, request, args in commands:
                    if command == "add":
                        self._add(request, *args)
                    else:
                        self._cancel(request)
                if commands:              # admissions and cancels show before a long step
                    self.stats = self._snapshot()
                if self._running:         # every request the Scheduler holds is in it
                    self._step()
                    self.stats = self._snapshot()
                out_of_memory = 0
            except MemoryError:
                out_of_memory += 1
                log.warning("a step ran out of memory (%d in a row); retrying", out_of_memory)
                if out_of_memory >= OUT_OF_MEMORY_RETRIES:
                    out_of_memory = 0
                    self._fail_running(RuntimeError("the engine failed: out of memory"))
            except Exception as exc:      # a failed step: its requests fail, the loop goes on
                log.exception("the engine failed; the requests it was running are cancelled")
                self._fail_running(RuntimeError(f"the engine failed: {exc}"))
        stopped = RuntimeError("the server is shutting down")
        for _, request, _ in self._commands:
            self._deliver(request, stopped)
        self._fail_running(stopped)

    def _add(self, request: _Request, prompt_ids: Any, gen_kwargs: dict[str, Any]) -> None:
        try:
            rid = self._scheduler.add(prompt_ids, **gen_kwargs)
        except Exception as exc:          # refused: only this request fails
            self._release()
            self._deliver(request, exc)
            return
        request.rid = rid
        self._running[rid] = request
        self._deliver(request, rid)

    def _cancel(self, request: _Request) -> None:
        if request.rid is not None and self._running.pop(request.rid, None) is not None:
            self._drop(request.rid)
            self._release()

    def _drop(self, rid: int) -> None:
        """Cancel `rid` in the Scheduler; a Scheduler that fails here has nothing to free."""
        try:
            self._scheduler.cancel(rid)
        except Exception:
            log.exception("cancelling request %d failed", rid)

    def _step(self) -> None:
        for event in self._scheduler.step():
            request = self._running[event.id]
            if event.finish is not None:
                del self._running[event.id]
                self._release()
            self._deliver(request, event)

    def _fail_running(self, error: BaseException) -> None:
        running, self._running = self._running, {}
        for rid, request in running.items():
            self._drop(rid)
            self._release()
            self._deliver(request, error)

    def _deliver(self, request: _Request, item: Any) -> None:
        try:
            request.loop.call_soon_threadsafe(request.queue.put_nowait, item)
        except RuntimeError:              # its event loop is closed: nobody is listening
            self._cancel(request)

    def _snapshot(self) -> dict[str, Any]:
        return dict(self._scheduler.stats(), cache=self.model.cache_stats(),
                    depths=self._scheduler.depth_counts())
