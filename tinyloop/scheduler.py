"""`Scheduler`: continuous batching over one Model (docs/api.md, "Continuous batching").

Requests are added at any time and run by iteration: each `step()` admits waiting requests
into the running batch, decodes one token for every running request that is past its prompt
(one batched pass in the native backend), or one round of self-speculative decoding for a
request with n_draft > 0 (1 .. n_draft tokens), and gives the prompts being prefilled chunks
of what is left of the step's token budget. A KV budget bounds the memory the running requests hold;
when a step would pass it, the newest running request is preempted and later recomputed,
losing nothing. Every request's tokens are exactly what `Model.generate` returns for it alone,
whatever else runs. The policy itself lives in the engine (libtinyloop's tl_sched, or
fallback/scheduler.py); this module checks arguments and names the events.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

from . import params as P
from .engine import EngineScheduler

if TYPE_CHECKING:
    from .model import Model, TokenIds

DEFAULT_MAX_BATCH = 32
DEFAULT_STEP_TOKENS = 512
# A server's bound on the requests that wait beyond max_batch running (serve/engine_loop.py).
DEFAULT_MAX_QUEUE = 256


class SchedulerEvent(NamedTuple):
    """Request `id` emitted `token`; `finish` is None while it runs, else why it ended:
    "stop" (eos or a stop sequence, this token included), "length" (max_tokens) or "error"
    (non-finite logits: token is -1). After a finish event the id is gone."""
    id: int
    token: int
    finish: Optional[str]


class Scheduler:
    """Scheduler(model, max_batch=32, step_tokens=512, kv_budget_bytes=0).

    max_batch: requests running at once (prefilling or decoding); step_tokens: positions a
    step computes at most (one per decoding request, a speculative round's drafted tokens, the
    rest in prompt chunks), >= max_batch;
    kv_budget_bytes: KV bytes the running requests may hold alone (blocks shared with the
    model's prefix cache count against its budget), 0 = no limit. Use from one thread at a
    time; `step` releases the GIL in the native backend.
    """

    def __init__(self, model: Model, max_batch: int = DEFAULT_MAX_BATCH,
                 step_tokens: int = DEFAULT_STEP_TOKENS, kv_budget_bytes: int = 0) -> None:
        max_batch = P.check_int("max_batch", max_batch, 1, 1 << 20)
        step_tokens = P.check_int("step_tokens", step_tokens, 1)
        if step_tokens < max_batch:
            raise ValueError(f"step_tokens {step_tokens} < max_batch {max_batch} (every running "
                             f"request may decode a token in a step)")
        kv_budget_bytes = P.check_int("kv_budget_bytes", kv_budget_bytes, 0)
        self._model = model
        self._engine: Optional[EngineScheduler] = model._live_engine().new_scheduler(
            max_batch, step_tokens, kv_budget_bytes)

    def _live(self) -> EngineScheduler:
        self._model._live_engine()              # "model was closed"
        if self._engine is None:
            raise RuntimeError("scheduler was closed")
        return self._engine

    def add(self, prompt: TokenIds, max_tokens: int = 32, loops: int | None = None,
            temperature: float = 0.0, top_k: int = 50, top_p: float = 1.0,
            cache_window: int = 0, repetition_penalty: float = 1.0,
            stop_sequences: Sequence[TokenIds] | None = (), seed: int | None = None,
            cache_salt: str | None = None, draft_loops: int | None = None,
            n_draft: int | None = None, exit_rule: str | None = None,
            exit_threshold: float | None = None, min_loops: int | None = None,
            instruction_length: int = 0) -> int:
        """Queue a request; Model.generate's arguments and errors (a prompt too long for
        max_seq_len: RuntimeError), plus ValueError when it alone could need more KV than
        kv_budget_bytes. With draft_loops (and n_draft) it decodes speculatively: a step runs
        one round of it, emitting 1 .. n_draft of its tokens (the same tokens); stats() counts
        the drafted and accepted ones. With exit_rule (exit_threshold, min_loops) its decoded
        tokens run at adaptive depth (docs/spec.md §5.7); stats() counts the decode passes and
        the core iterations they ran. instruction_length: its prompt's instruction block
        (docs/spec.md §4.1, §5.5: prefilled in one chunk, even past step_tokens). Returns its
        id."""
        engine = self._live()
        tokens, _, params = self._model._request(prompt, None, dict(
            max_tokens=max_tokens, loops=loops, temperature=temperature, top_k=top_k,
            top_p=top_p, cache_window=cache_window, repetition_penalty=repetition_penalty,
            stop_sequences=stop_sequences, seed=seed, cache_salt=cache_salt,
            draft_loops=draft_loops, n_draft=n_draft, exit_rule=exit_rule,
            exit_threshold=exit_threshold, min_loops=min_loops,
            instruction_length=instruction_length))
        return engine.add(tokens, params)

    def cancel(self, request_id: int) -> bool:
        """Remove a waiting or running request (it emits nothing more); False if none has
        that id (it finished, was cancelled, or never existed)."""
        return self._live().cancel(P.check_int("request_id", request_id, 0, (1 << 64) - 1))

    def step(self) -> list[SchedulerEvent]:
        """Run one iteration; [] when there is nothing to run. A request gets at most one
        event a step, a speculative one one per token its round emits (in token order). A step
        that raises (e.g. MemoryError) may simply be retried: no request loses or changes a
        token."""
        return [SchedulerEvent(*event) for event in self._live().step()]

    @property
    def has_work(self) -> bool:
        """Whether any request is running or waiting."""
        counts = self.stats()
        return counts["running"] + counts["waiting"] > 0

    def stats(self) -> dict[str, int]:
        """running, waiting, steps, prompt_tokens (positions prefilled, recomputation
        included), cached_tokens (positions the prefix cache served), generated_tokens,
        preemptions, finished, cancelled, kv_blocks and kv_bytes (held alone by the running
        requests), kv_budget_bytes, drafted_tokens and accepted_tokens (of the speculative
        requests' rounds: tokens drafted, and drafted tokens the verifier emitted too)."""
        return self._live().stats()

    def depth_counts(self) -> list[int]:
        """The decode passes stats() counts in decode_passes by the core iterations they ran
        (adaptive depth, docs/spec.md §5.7): entry u - 1 counts those that ran u iterations, up
        to the deepest counted ([] before any decode pass)."""
        return self._live().depth_counts()

    def close(self) -> None:
        """Drop every request; idempotent."""
        if self._engine is not None:
            self._engine.free()
            self._engine = None

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
