"""The engine seam: what `tinyloop.Model` asks of a backend, declared once.

An *engine* runs one opened model file. `Model` checks every argument (tinyloop/params.py) and
then calls only what the `Engine` protocol below declares, so a call can be followed from
`Model.generate` to `Engine.generate` and from there into either implementation:

    tinyloop.native.NativeEngine     libtinyloop through cffi (backend "native")
    tinyloop.fallback.Engine         the Python engine, run by a kernel set (backends "numpy",
                                     "numba", "numba-cuda"; fallback/forward.py)

tests/test_engine_seam.py checks that both satisfy the protocol, signatures included.
Engines are made by `tinyloop.backends.open_engine`, the only place that names a backend:
construction is where the backends differ (a C library, a kernel set), so it is not part of
the protocol.

This module also holds the values that cross the seam: the checked request
(`GenerationParams`, `Callbacks`), the stop rule every engine applies and the names of the
prefix cache's counters. Imports run one way: this module imports only the standard library,
numpy and tinyloop.config; the engines import it, and nothing here imports an engine,
tinyloop.model, tinyloop.backends or the CLI.
"""
from dataclasses import dataclass
from typing import (Any, Callable, Container, Dict, List, Optional, Protocol, Sequence, Tuple,
                    TypeVar, Union, runtime_checkable)

import numpy as np

from .config import ModelConfig

# Why a scheduled request ended, by tl_finish value (docs/api.md, "Continuous batching").
FINISH_REASONS = (None, "stop", "length", "error")
# Counters of a scheduler, in the order of tl_sched_stats (docs/api.md).
SCHED_STAT_NAMES = ("running", "waiting", "steps", "prompt_tokens", "cached_tokens",
                    "generated_tokens", "preemptions", "finished", "cancelled", "kv_blocks",
                    "kv_bytes", "kv_budget_bytes", "drafted_tokens", "accepted_tokens",
                    "decode_passes", "decode_loops", "mixed_passes")
# Counters of the automatic prefix cache, in the order of tl_prefix_cache_stats (docs/api.md).
CACHE_STAT_NAMES = ("lookups", "hit_tokens", "prefilled_tokens", "inserted_blocks",
                    "evicted_blocks", "blocks", "bytes_in_use", "budget_bytes",
                    "spilled_blocks", "disk_hit_blocks", "disk_bytes", "disk_budget_bytes",
                    "disk_write_failures")
# Adaptive depth's exit rules (docs/spec.md §5.7), by tl_exit_rule value.
EXIT_RULES = ("none", "gate", "latent", "kl", "argmax")
# The default thresholds of the rules that work on any model (Huginn's "auto" values); the gate
# rule's is the model file's exit_threshold.
EXIT_DEFAULT_THRESHOLDS = {"latent": 0.03, "kl": 0.001, "argmax": 5}
# The argmax rule's threshold: a count of steps, an integer in 1 .. MAX_ARGMAX_STEPS.
MAX_ARGMAX_STEPS = 1024
# What a prefix keeps at rest (docs/spec.md §5.4.1): its KV, or each layer's input row.
PREFIX_STORAGES = ("kv", "h8", "h4")
# The keys of Engine.runtime(), every engine alike (docs/api.md, "Backends").
RUNTIME_KEYS = ("backend", "device", "device_name", "isa", "threads", "kv_block_size",
                "weight_bytes", "device_weight_bytes", "kv_mode")


@dataclass(frozen=True)
class GenerationParams:
    """One generation request's parameters, already checked (tinyloop.params)."""
    max_tokens: int            # tokens to emit at most (>= 1)
    loops: int                 # loop-block depth L (>= 1)
    cache_window: int          # sliding attention window in tokens; 0 = full context
    temperature: float         # 0 = greedy argmax
    top_k: int                 # 0 = off
    top_p: float               # in (0, 1]; 1 = off
    repetition_penalty: float  # 1 = off
    stop_sequences: Tuple[Tuple[int, ...], ...]   # non-empty tuples of token ids
    seed: int                  # u64 key of the counter-based generator
    prefill_chunk: int         # prompt tokens per forward chunk (>= 1)
    cache_salt: str = ""       # tenant key of the automatic prefix cache ("" = none)
    draft_loops: int = 0       # self-speculative decoding's draft depth, 1 .. loops-1 when
                               # n_draft > 0 (docs/spec.md §5.6), or 0 in the wave: chosen
                               # from the acceptance (§5.6.1); else ignored
    n_draft: int = 0           # tokens drafted a round, 0 .. 64; 0 = plain decoding
    draft_wave: bool = False   # with n_draft > 0: the wave schedule (docs/spec.md §5.6.1) on a
                               # backend with a wave pass, else rounds (the same tokens)
    exit_rule: str = "none"    # adaptive depth (docs/spec.md §5.7): one of EXIT_RULES
    exit_threshold: float = 0.0   # the rule's q, resolved (never 0 with a rule)
    min_loops: int = 1         # iterations every decoded token runs at least, 1 .. loops
    instruction_length: int = 0   # prompt positions forming an instruction block (docs/spec.md
                                  # §4.1), 0 .. len(prompt); 0 from a prefix (it has its own)


@dataclass(frozen=True)
class Callbacks:
    """A request's callbacks (each None or a callable); an exception raised in one stops the
    request and propagates."""
    on_token: Optional[Callable[[int], None]] = None          # after each emitted token
    on_prefill: Optional[Callable[[int, int], None]] = None   # (done, total) after each chunk
    # (drafted, accepted) increments of speculative decoding, whose sums are the request's
    # totals: after every round (the Python engine) or once at the end (the native engine)
    on_draft: Optional[Callable[[int, int], None]] = None
    # (decode passes, core iterations they ran) increments, whose sums give a request's mean
    # loops per token (docs/spec.md §5.7): after every decode pass (the Python engine) or once
    # at the end (the native engine)
    on_depth: Optional[Callable[[int, int], None]] = None


NO_CALLBACKS = Callbacks()


def finish_reason(emitted: Sequence[int], params: GenerationParams, stop_ids: Container[int]
                  ) -> Optional[str]:
    """spec §5.3: "stop" for one of the model's stop ids (ModelConfig.stop_token_ids()), then
    stop sequences on the emitted tokens, then "length" for max_tokens; None while generation
    goes on."""
    if emitted[-1] in stop_ids:
        return "stop"
    for seq in params.stop_sequences:
        if len(emitted) >= len(seq) and tuple(emitted[-len(seq):]) == seq:
            return "stop"
    return "length" if len(emitted) >= params.max_tokens else None


def check_prefix_storage(storage: object, name: str = "storage", warm_start: bool = False) -> str:
    """`storage` itself when it is one of PREFIX_STORAGES, else ValueError naming them (and
    the argument, `name`); an h storage with `warm_start` is refused too (docs/spec.md
    §5.4.1: an h prefix has no warm start), with the same words on every backend."""
    if not isinstance(storage, str) or storage not in PREFIX_STORAGES:
        raise ValueError(f"{name} {storage!r} is not supported; use one of "
                         f"{', '.join(map(repr, PREFIX_STORAGES))}")
    if warm_start and storage != "kv":
        raise ValueError(f"a hidden-state prefix ({storage}) has no warm start: drop "
                         "warm_start or use the kv storage")
    return storage


def loops_mismatch(built: int, requested: int) -> str:
    """The refusal of a prefix asked for a depth past its own (docs/api.md, "Warm start")."""
    return (f"loops mismatch: prefix built at loops={built}, requested {requested} (a prefix "
            "serves loops <= its own; build it with warm_start=True to extend it)")


def stop_reached(emitted: Sequence[int], params: GenerationParams, stop_ids: Container[int]
                 ) -> bool:
    """Whether a stop rule fires (finish_reason)."""
    return finish_reason(emitted, params, stop_ids) is not None


@runtime_checkable
class EnginePrefix(Protocol):
    """A prompt's KV built by `Engine.build_prefix`, shared by every generation from it and
    unchanged by them; only Engine.extend_prefix deepens it. `tinyloop.PrefixCache` wraps one
    and calls `free` when it is collected."""
    tokens: np.ndarray         # (n,) int32, the engine's own copy of the prompt
    cache_window: int          # the window it was built with; it serves only that window
    instruction: int           # its instruction length (docs/spec.md §4.1), 0 .. len(tokens)

    @property
    def loops(self) -> int:
        """Its depth (built at, or extended to); it serves any depth <= loops."""

    @property
    def warm_start(self) -> bool:
        """Whether it keeps what Engine.extend_prefix needs (built with warm_start=True)."""

    @property
    def storage(self) -> str:
        """What it keeps at rest, one of PREFIX_STORAGES (docs/spec.md §5.4.1)."""

    @property
    def nbytes(self) -> int:
        """Bytes it holds (KV blocks and the rest; docs/api.md counts them per backend)."""

    def to_bytes(self) -> bytes:
        """The prefix blob (docs/spec.md §7): the same bytes on every engine for the same
        prefix (model, KV mode, block size, window); safe beside extend_prefix of it."""

    def free(self) -> None:
        """Release its memory; idempotent. Generations already started from it are unaffected."""


# An engine's own prefix type: an engine is handed back only the prefixes it built (Model
# checks that a PrefixCache belongs to it), so Engine is generic in it.
PrefixT = TypeVar("PrefixT", bound=EnginePrefix)
# What a generation returns: the emitted ids and, when asked for, the (vocab_size,) float32
# logits each was sampled from (an engine may return them even when not asked).
Generated = Tuple[List[int], Optional[List[np.ndarray]]]
# One request of generate_batch: (prefix or None, prompt or suffix ids, params, callbacks).
Request = Tuple[Optional[PrefixT], np.ndarray, GenerationParams, Callbacks]


# One event of a scheduler step: (request id, emitted token, finish reason or None).
SchedulerEvent = Tuple[int, int, Optional[str]]


@runtime_checkable
class EngineScheduler(Protocol):
    """Continuous batching over one engine (Engine.new_scheduler), used by one thread at a
    time. Each request's tokens equal Engine.generate's for it, whatever else runs."""

    def add(self, prompt: np.ndarray, params: GenerationParams) -> int:
        """Queue a checked request; returns its id (>= 1). ValueError when it alone could
        need more KV than the budget."""

    def cancel(self, request_id: int) -> bool:
        """Remove a waiting or running request; False if there is none with that id."""

    def step(self) -> List[SchedulerEvent]:
        """Run one iteration; at most one event per request, but a speculative request's
        round emits its tokens that step (finish: FINISH_REASONS). A step that raises may be
        retried: no request's tokens change."""

    def stats(self) -> Dict[str, int]:
        """{name: int for name in SCHED_STAT_NAMES}."""

    def depth_counts(self) -> List[int]:
        """The decode passes stats() counts in decode_passes, by the core iterations they ran:
        entry u - 1 counts those that ran u iterations, up to the deepest counted ([] before
        any)."""

    def free(self) -> None:
        """Drop every request; idempotent."""


@runtime_checkable
class Engine(Protocol[PrefixT]):
    """The interface every backend implements. Arguments arrive checked: token arrays are 1-D
    int32 with ids in [0, vocab_size) and lengths within max_seq_len, params.loops <= the
    prefix's loops, and the window equals the prefix's. Results are bit-identical across
    engines (docs/spec.md). Errors: ValueError / RuntimeError with the API's phrases
    (docs/api.md), MemoryError for an allocation that failed."""
    config: ModelConfig        # the opened file's configuration

    def runtime(self) -> Dict[str, Any]:
        """How this model runs here: a dict with exactly RUNTIME_KEYS: `backend` (its name in
        tinyloop.backends.BACKENDS), `device` ("cpu" or "cuda"), `device_name` (e.g.
        "cpu (avx2)"), `isa` (the kernel path), `threads`, `kv_block_size`, `weight_bytes`
        (weights held in host memory), `device_weight_bytes` (in device memory) and `kv_mode`
        ("int8" or "int4", how the KV cache stores keys and values)."""

    def generate(self, prompt: np.ndarray, params: GenerationParams, want_logits: bool = False,
                 callbacks: Callbacks = NO_CALLBACKS) -> Generated:
        """Prefill `prompt` (reusing the automatic prefix cache, in params.prefill_chunk
        chunks), then sample until stop_reached."""

    def build_prefix(self, prompt: np.ndarray, loops: int, window: int,
                     chunk: int, warm_start: bool = False, storage: str = "kv",
                     instruction: int = 0) -> PrefixT:
        """Prefill `prompt` at depth `loops` with attention window `window` (0 = none);
        `warm_start` also keeps every token's state after the last iteration (and its
        injected term), what extend_prefix needs (docs/spec.md §5.4). `storage` (one of
        PREFIX_STORAGES) "h8" / "h4" keeps each layer's input row instead of the KV (§5.4.1);
        ValueError naming the reason where it cannot (with warm_start, or rows as large as
        the KV). Its first `instruction` tokens are an instruction block (§4.1)."""

    def extend_prefix(self, prefix: PrefixT, loops: int, chunk: int) -> None:
        """Deepen a warm-start prefix to `loops` in place (prefix.loops becomes loops),
        running only the missing iterations, `chunk` tokens a pass: bit-identical to a prefix
        built at `loops`. A no-op when loops <= prefix.loops; RuntimeError "loops mismatch"
        for a prefix built without warm start. Generations already running from it keep
        their KV; safe beside concurrent generations from it."""

    def prefix_from_bytes(self, blob: Union[bytes, bytearray, memoryview]) -> PrefixT:
        """The prefix whose to_bytes() (on any engine of this model file and KV mode) gave
        `blob` (C-contiguous): every generation from it is the original's, and its to_bytes()
        is `blob` again when this engine's block size is the saver's.
        tinyloop.errors.PrefixFormatError naming the field for a corrupted blob or one of
        another model or KV mode."""

    def generate_from_prefix(self, prefix: PrefixT, suffix: np.ndarray,
                             params: GenerationParams, want_logits: bool = False,
                             callbacks: Callbacks = NO_CALLBACKS) -> Generated:
        """Feed `suffix` (possibly empty) after `prefix`, which stays unchanged, then sample:
        exactly what generate(prefix.tokens + suffix) gives."""

    def generate_batch(self, requests: Sequence[Request[PrefixT]],
                       want_logits: bool = False) -> List[Generated]:
        """Run every request; returns one Generated per request, in order, each exactly what
        the request alone would give."""

    def logits(self, tokens: np.ndarray, loops: int, window: int, chunk: int,
               instruction: int = 0) -> np.ndarray:
        """The (len(tokens), vocab_size) float32 logits at every position, its first
        `instruction` tokens an instruction block (docs/spec.md §4.1)."""

    def new_scheduler(self, max_batch: int, step_tokens: int,
                      kv_budget_bytes: int) -> EngineScheduler:
        """An empty scheduler: at most max_batch requests running, step_tokens positions a
        step (>= max_batch), kv_budget_bytes of KV the running requests hold alone (0: no
        limit); the policy of docs/api.md, "Continuous batching"."""

    def cache_stats(self) -> Dict[str, int]:
        """The automatic prefix cache's counters: {name: int for name in CACHE_STAT_NAMES}
        (all 0 when the model has none)."""

    def clear_prefix_cache(self) -> None:
        """Drop every cached block; requests running on them keep theirs."""

    def close(self) -> None:
        """Release the model. Called once, by Model.close."""
