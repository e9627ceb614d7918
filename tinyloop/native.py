"""The native backend: libtinyloop driven through cffi.

Every C handle is wrapped with ffi.gc right after its NULL check; the destructor closes over
the loaded library, so objects collected at interpreter shutdown still free cleanly. cffi
releases the GIL during every C call, so threads sharing one model run in parallel. A failed
call is turned into the exception type the Python API documents, with the library's message.
`NativeEngine` implements the engine interface (tinyloop/engine.py); tinyloop.backends opens it.
"""
from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Sequence

import numpy as np

from .config import ModelConfig
from .errors import ModelFormatError, PrefixFormatError
from .engine import (CACHE_STAT_NAMES, EXIT_RULES, FINISH_REASONS, NO_CALLBACKS, SCHED_STAT_NAMES,
                     Callbacks, Generated, GenerationParams, Request, SchedulerEvent)

TOKENIZERS = {0: "none", 1: "bytes", 2: "hf"}
WEIGHT_FORMATS = {1: "int8", 2: "int4"}
BLOCK_LAYOUTS = {0: "pre", 1: "sandwich", 2: "post"}
# The CPU kernel paths (tl_isa), named as TINYLOOP_ISA names them. A TINYLOOP_AMX_EMULATION
# build (tests only) runs "amx" on tiles emulated in C, and its device_name says "amx-emulated".
ISAS = {1: "scalar", 2: "avx2", 3: "avx512-vnni", 4: "amx"}


def _error_types(lib: Any) -> dict[int, type[Exception]]:
    value_errors = (lib.TL_ERR_INVALID_ARGUMENT, lib.TL_ERR_OUT_OF_RANGE, lib.TL_ERR_WRONG_MODEL)
    table: dict[int, type[Exception]] = {status: ValueError for status in value_errors}
    table[lib.TL_ERR_BAD_FILE] = ModelFormatError
    table[lib.TL_ERR_IO] = OSError
    table[lib.TL_ERR_OUT_OF_MEMORY] = MemoryError     # the Engine contract: a step may be retried
    return table


class NativePrefix:
    """A tl_prefix handle and what the Python side needs to know about it (an EnginePrefix).
    Its depth and size are read from the library: tl_prefix_extend deepens it in place."""

    def __init__(self, engine: NativeEngine, handle: Any, tokens: np.ndarray,
                 window: int) -> None:
        self.handle = handle
        self.tokens = tokens          # (n,) int32 copy
        self.cache_window = window
        self.warm_start = bool(engine.lib.tl_prefix_warm_start(handle))
        self.instruction = int(engine.lib.tl_prefix_instruction(handle))
        lib = engine.lib
        self.storage = {lib.TL_STORE_KV: "kv", lib.TL_STORE_H8: "h8",
                        lib.TL_STORE_H4: "h4"}[lib.tl_prefix_storage_get(handle)]
        self._engine = engine

    def _info(self) -> tuple[int, int]:
        """(loops, nbytes) as tl_prefix_info says now."""
        ffi = self._engine.ffi
        loops, nbytes = ffi.new("uint32_t*"), ffi.new("size_t*")
        self._engine.lib.tl_prefix_info(self.handle, ffi.NULL, loops, ffi.NULL, nbytes)
        return int(loops[0]), int(nbytes[0])

    @property
    def loops(self) -> int:
        return self._info()[0]

    @property
    def nbytes(self) -> int:
        return self._info()[1]

    def to_bytes(self) -> bytes:
        """tl_prefix_save: a size query, then the blob; again if an extension grew it between."""
        ffi, lib = self._engine.ffi, self._engine.lib
        size = ffi.new("size_t*")
        self._engine._check(lib.tl_prefix_save(self.handle, ffi.NULL, 0, size))
        while True:
            buf = bytearray(size[0])
            status = lib.tl_prefix_save(self.handle, ffi.from_buffer(buf), len(buf), size)
            if status != lib.TL_ERR_INVALID_ARGUMENT or size[0] <= len(buf):
                self._engine._check(status)
                return bytes(memoryview(buf)[:size[0]])     # one copy of a large blob

    def free(self) -> None:
        if self.handle is not None:
            self._engine.ffi.release(self.handle)
            self.handle = None


class NativeScheduler:
    """A tl_sched handle (an EngineScheduler). Its event arrays are allocated once; a step
    releases the GIL for the whole iteration."""

    def __init__(self, engine: NativeEngine, max_batch: int, step_tokens: int,
                 kv_budget_bytes: int) -> None:
        self._engine = engine
        ffi, lib = engine.ffi, engine.lib
        params = ffi.new("tl_sched_params*", lib.tl_sched_params_default())
        params.max_batch, params.step_tokens = max_batch, step_tokens
        params.kv_budget_bytes = kv_budget_bytes
        out = ffi.new("tl_sched**")
        engine._check(lib.tl_sched_create(engine.model, params, out))
        self.handle = engine._owned(out, "tl_sched_free")
        # a step emits at most step_tokens events (one per position it computes), so this
        # capacity never caps a speculative round below what step_tokens allows
        self._capacity = step_tokens
        self._ids = ffi.new("uint64_t[]", step_tokens)
        self._tokens = ffi.new("int32_t[]", step_tokens)
        self._finish = ffi.new("uint8_t[]", step_tokens)
        self._n_events = ffi.new("size_t*")

    def add(self, prompt: np.ndarray, params: GenerationParams) -> int:
        engine = self._engine
        keep: list[Any] = []
        prompt, buf = engine._tokens(prompt)
        p = engine._gen_params(params, keep)
        request_id = engine.ffi.new("uint64_t*")
        engine._check(engine.lib.tl_sched_add(self.handle, buf, len(prompt), p, request_id))
        return int(request_id[0])

    def cancel(self, request_id: int) -> bool:
        return bool(self._engine.lib.tl_sched_cancel(self.handle, request_id) == self._engine.lib.TL_OK)

    def step(self) -> list[SchedulerEvent]:
        status = self._engine.lib.tl_sched_step(self.handle, self._ids, self._tokens, self._finish,
                                                self._capacity, self._n_events)
        n = int(self._n_events[0])
        events = [(int(self._ids[i]), int(self._tokens[i]), FINISH_REASONS[self._finish[i]])
                  for i in range(n)]
        if status != self._engine.lib.TL_OK and not events:
            self._engine._check(status)
        return events

    def stats(self) -> dict[str, int]:
        s = self._engine.ffi.new("tl_sched_stats*")
        s.size = self._engine.ffi.sizeof("tl_sched_stats")
        self._engine._check(self._engine.lib.tl_sched_stats_get(self.handle, s))
        return {name: int(getattr(s, name)) for name in SCHED_STAT_NAMES}

    def depth_counts(self) -> list[int]:
        ffi, lib = self._engine.ffi, self._engine.lib
        n = ffi.new("size_t*")
        self._engine._check(lib.tl_sched_depth_counts(self.handle, ffi.NULL, 0, n))
        counts = ffi.new("uint64_t[]", max(1, int(n[0])))
        self._engine._check(lib.tl_sched_depth_counts(self.handle, counts, int(n[0]), n))
        return [int(c) for c in counts[0:int(n[0])]]

    def free(self) -> None:
        if self.handle is not None:
            self._engine.ffi.release(self.handle)
            self.handle = None


class NativeEngine:
    """A tl_model: the engine of backend "native" (`loaded` is backends.native_library())."""

    def __init__(self, loaded: tuple[Any, Any, Path, str], path: str | os.PathLike[str], *,
                 block_size: int, threads: int | None, prefix_cache_bytes: int = 0,
                 device: str = "auto", kv_mode: str = "int8",
                 prefix_cache_dir: str | None = None, prefix_cache_disk_bytes: int = 0) -> None:
        self.ffi, self.lib, self.library_path, self.library_origin = loaded
        self._errors = _error_types(self.lib)
        params = self.ffi.new("tl_model_params*", self.lib.tl_model_params_default())
        params.kv_block_size = block_size
        params.n_threads = threads or 0
        params.prefix_cache_bytes = prefix_cache_bytes
        params.device = {"auto": self.lib.TL_DEVICE_AUTO, "cpu": self.lib.TL_DEVICE_CPU,
                         "cuda": self.lib.TL_DEVICE_CUDA}[device]
        params.kv_mode = self._kv_modes()[kv_mode]
        # the library copies the string; `directory` keeps it alive until then
        directory = (self.ffi.NULL if prefix_cache_dir is None
                     else self.ffi.new("char[]", os.fsencode(prefix_cache_dir)))
        params.prefix_cache_dir = directory
        params.prefix_cache_disk_bytes = prefix_cache_disk_bytes
        out = self.ffi.new("tl_model**")
        self._check(self.lib.tl_model_open(str(path).encode(), params, out))
        self.model = self._owned(out, "tl_model_free")
        self.config = self._read_config()

    # -- plumbing ---------------------------------------------------------------------------
    def _check(self, status: int) -> None:
        if status != self.lib.TL_OK:
            message = self.ffi.string(self.lib.tl_last_error()).decode("utf-8", "replace")
            if status == self.lib.TL_ERR_IO and "No such file" in message:
                raise FileNotFoundError(message)
            raise self._errors.get(status, RuntimeError)(message)

    def _owned(self, out: Any, free: str) -> Any:
        """The new handle in *out, freed by the library's `free` function when collected."""
        if out[0] == self.ffi.NULL:
            raise RuntimeError(f"libtinyloop returned success but no handle (for {free})")
        release = getattr(self.lib, free)     # keeps the library alive inside the destructor
        return self.ffi.gc(out[0], release)

    def _read_config(self) -> ModelConfig:
        c = self.ffi.new("tl_model_config*")
        c.size = self.ffi.sizeof("tl_model_config")
        self._check(self.lib.tl_model_config_get(self.model, c))
        return ModelConfig(
            vocab_size=c.vocab_size, d_model=c.d_model, n_heads=c.n_heads,
            n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, ffn_dim=c.ffn_dim,
            n_pre_blocks=c.n_pre_blocks, default_loops=c.default_loops,
            max_seq_len=c.max_seq_len, weight_format=WEIGHT_FORMATS[c.weight_format],
            group_size=c.group_size, tied_head=bool(c.tied_head), bos_id=c.bos_id,
            eos_id=c.eos_id, tokenizer=TOKENIZERS[c.tokenizer], rope_theta=c.rope_theta,
            rms_eps=c.rms_eps, name=self.ffi.string(c.name).decode("utf-8"),
            n_core_blocks=c.n_core_blocks, n_coda_blocks=c.n_coda_blocks,
            block_layout=BLOCK_LAYOUTS[c.block_layout], qkv_bias=bool(c.qkv_bias),
            injection=bool(c.injection), step_norm=bool(c.step_norm),
            embed_scale=c.embed_scale, coda_norm=bool(c.coda_norm),
            stop_ids=tuple(c.stop_ids[0:c.n_stop_ids]), exit_gate=bool(c.exit_gate),
            exit_threshold=c.exit_threshold, core_cycles=c.core_cycles,
            attn_gate=bool(c.attn_gate), loop_window=c.loop_window, act_block=c.act_block)

    def _kv_modes(self) -> dict[str, int]:
        return {"int8": self.lib.TL_KV_INT8, "int4": self.lib.TL_KV_INT4}

    def runtime(self) -> dict[str, Any]:
        r = self.ffi.new("tl_model_runtime*")
        r.size = self.ffi.sizeof("tl_model_runtime")
        self._check(self.lib.tl_model_runtime_get(self.model, r))
        isa = ISAS.get(r.isa, str(r.isa))
        device = "cuda" if r.device == self.lib.TL_DEVICE_CUDA else "cpu"
        return {"backend": "native", "device": device,
                "device_name": self.ffi.string(r.device_name).decode("utf-8", "replace"),
                "isa": isa, "threads": r.n_threads, "kv_block_size": r.kv_block_size,
                "weight_bytes": r.weight_bytes, "device_weight_bytes": r.device_weight_bytes,
                "kv_mode": {v: k for k, v in self._kv_modes().items()}[r.kv_mode]}

    def _tokens(self, tokens: Any) -> tuple[np.ndarray, Any]:
        tokens = np.ascontiguousarray(tokens, np.int32)
        return tokens, self.ffi.from_buffer("int32_t[]", tokens)

    def _gen_params(self, params: GenerationParams, keep: list[Any]) -> Any:
        p = self.ffi.new("tl_gen_params*", self.lib.tl_gen_params_default())
        p.max_tokens = params.max_tokens
        p.loops = params.loops
        p.cache_window = params.cache_window
        p.temperature = params.temperature
        p.top_k = params.top_k
        p.top_p = params.top_p
        p.repetition_penalty = params.repetition_penalty
        p.seed = params.seed
        p.prefill_chunk = params.prefill_chunk
        p.draft_loops = params.draft_loops
        p.n_draft = params.n_draft
        p.draft_wave = int(params.draft_wave)
        p.exit_rule = EXIT_RULES.index(params.exit_rule)
        p.exit_threshold = params.exit_threshold
        p.min_loops = params.min_loops
        p.instruction_length = params.instruction_length
        if params.cache_salt:
            keep.append(self.ffi.new("char[]", params.cache_salt.encode("utf-8")))
            p.cache_salt = keep[-1]
        if params.stop_sequences:
            flat = [t for seq in params.stop_sequences for t in seq]
            keep.append(self.ffi.new("int32_t[]", flat))
            keep.append(self.ffi.new("size_t[]", [len(s) for s in params.stop_sequences]))
            p.stop_tokens, p.stop_lengths = keep[-2], keep[-1]
            p.n_stop = len(params.stop_sequences)
        return p

    def _callback(self, ctype: str, fn: Callable[..., None], raised: list[BaseException]) -> Any:
        """A C callback of type `ctype` calling fn with its arguments after user_data (as
        ints); an exception stops the request (a KeyboardInterrupt during a long prefill
        lands here) and is kept in `raised`."""
        def onerror(exc_type: type[BaseException], exc: BaseException,
                    tb: TracebackType | None) -> int:
            raised.append(exc)
            return 1

        def call(user_data: Any, *args: Any) -> int:
            fn(*map(int, args))
            return 0

        return self.ffi.callback(ctype, call, onerror=onerror)

    def _request_params(self, params: GenerationParams, callbacks: Callbacks, keep: list[Any],
                        raised: list[BaseException]) -> Any:
        """tl_gen_params for `params`, with callbacks.on_token / on_prefill wired to C and,
        with callbacks.on_draft / on_depth, a tl_draft_stats / tl_depth_stats that _report_counts
        hands to it."""
        p = self._gen_params(params, keep)
        if callbacks.on_token is not None:
            keep.append(self._callback("tl_token_fn", callbacks.on_token, raised))
            p.on_token = keep[-1]
        if callbacks.on_prefill is not None:
            keep.append(self._callback("tl_progress_fn", callbacks.on_prefill, raised))
            p.on_prefill = keep[-1]
        if callbacks.on_draft is not None:
            keep.append(self.ffi.new("tl_draft_stats*"))
            p.draft_stats = keep[-1]
        if callbacks.on_depth is not None:
            keep.append(self.ffi.new("tl_depth_stats*"))
            p.depth_stats = keep[-1]
        return p

    @staticmethod
    def _report_counts(p: Any, callbacks: Callbacks) -> None:
        """The library's totals for a call that returned (also one that failed part-way),
        handed to on_draft and on_depth once each (docs/api.md)."""
        if callbacks.on_draft is not None:
            callbacks.on_draft(int(p.draft_stats.drafted), int(p.draft_stats.accepted))
        if callbacks.on_depth is not None:
            callbacks.on_depth(int(p.depth_stats.tokens), int(p.depth_stats.loops))

    def _outputs(self, params: GenerationParams,
                 want_logits: bool) -> tuple[Any, np.ndarray | None, Any]:
        """(out_tokens cdata, logits array or None, its float* or NULL) for one request."""
        out_tokens = self.ffi.new("int32_t[]", params.max_tokens)
        logits = np.empty((params.max_tokens, self.config.vocab_size), np.float32) if want_logits else None
        out_logits = self.ffi.from_buffer("float[]", logits) if want_logits else self.ffi.NULL
        return out_tokens, logits, out_logits

    def _finish(self, status: int, raised: list[BaseException]) -> None:
        if raised:
            raise raised[0]
        self._check(status)

    def _run_generation(self, call: Callable[[Any, Any, Any, Any], int], params: GenerationParams,
                        want_logits: bool, callbacks: Callbacks) -> Generated:
        """call(gen_params, out_tokens, n_out, out_logits) -> status."""
        keep: list[Any] = []
        raised: list[BaseException] = []
        p = self._request_params(params, callbacks, keep, raised)
        out_tokens, logits, out_logits = self._outputs(params, want_logits)
        n_out = self.ffi.new("size_t*")
        status = call(p, out_tokens, n_out, out_logits)
        self._report_counts(p, callbacks)
        self._finish(status, raised)
        n = int(n_out[0])
        return list(self.ffi.unpack(out_tokens, n)), (list(logits[:n]) if logits is not None else None)

    # -- the engine interface ---------------------------------------------------------------
    def generate(self, prompt: np.ndarray, params: GenerationParams, want_logits: bool = False,
                 callbacks: Callbacks = NO_CALLBACKS) -> Generated:
        prompt, buf = self._tokens(prompt)
        return self._run_generation(
            lambda p, toks, n, lg: self.lib.tl_generate(self.model, buf, len(prompt), p, toks, n, lg),
            params, want_logits, callbacks)

    def build_prefix(self, prompt: np.ndarray, loops: int, window: int, chunk: int,
                     warm_start: bool = False, storage: str = "kv",
                     instruction: int = 0) -> NativePrefix:
        prompt, buf = self._tokens(prompt)
        out = self.ffi.new("tl_prefix**")
        store = {"kv": 0, "h8": self.lib.TL_PREFIX_STORE_H8, "h4": self.lib.TL_PREFIX_STORE_H4}
        flags = (self.lib.TL_PREFIX_WARM_START if warm_start else 0) | store[storage]
        self._check(self.lib.tl_prefix_build_instruction(self.model, buf, len(prompt), instruction,
                                                         loops, window, chunk, flags, out))
        return NativePrefix(self, self._owned(out, "tl_prefix_free"), prompt.copy(), window)

    def prefix_from_bytes(self, blob: bytes | bytearray | memoryview) -> NativePrefix:
        out = self.ffi.new("tl_prefix**")
        view = memoryview(blob).cast("B")
        status = self.lib.tl_prefix_load(self.model, self.ffi.from_buffer(view), view.nbytes, out)
        if status == self.lib.TL_ERR_BAD_FILE:      # the blob's fault, not a model file's
            message = self.ffi.string(self.lib.tl_last_error()).decode("utf-8", "replace")
            raise PrefixFormatError(message)
        self._check(status)
        handle = self._owned(out, "tl_prefix_free")
        n, window = self.ffi.new("size_t*"), self.ffi.new("uint32_t*")
        tokens = self.ffi.buffer(self.lib.tl_prefix_tokens(handle, n), 4 * n[0])
        self.lib.tl_prefix_info(handle, self.ffi.NULL, self.ffi.NULL, window, self.ffi.NULL)
        return NativePrefix(self, handle, np.frombuffer(tokens, np.int32).copy(), int(window[0]))

    def extend_prefix(self, prefix: NativePrefix, loops: int, chunk: int) -> None:
        self._check(self.lib.tl_prefix_extend(prefix.handle, loops, chunk))

    def generate_from_prefix(self, prefix: NativePrefix, suffix: np.ndarray,
                             params: GenerationParams, want_logits: bool = False,
                             callbacks: Callbacks = NO_CALLBACKS) -> Generated:
        suffix, buf = self._tokens(suffix)
        return self._run_generation(
            lambda p, toks, n, lg: self.lib.tl_generate_from_prefix(
                prefix.handle, buf, len(suffix), p, toks, n, lg),
            params, want_logits, callbacks)

    def logits(self, tokens: np.ndarray, loops: int, window: int, chunk: int,
               instruction: int = 0) -> np.ndarray:
        out = self.ffi.new("tl_seq**")
        self._check(self.lib.tl_seq_create(self.model, loops, window, out))
        seq = self._owned(out, "tl_seq_free")
        tokens, buf = self._tokens(tokens)
        result = np.empty((len(tokens), self.config.vocab_size), np.float32)
        try:
            self._check(self.lib.tl_seq_set_instruction(seq, instruction))
            self._check(self.lib.tl_seq_prefill_all(seq, buf, len(tokens), chunk,
                                                    self.ffi.from_buffer("float[]", result)))
        finally:
            self.ffi.release(seq)
        return result

    def generate_batch(self, requests: Sequence[Request[NativePrefix]],
                       want_logits: bool = False) -> list[Generated]:
        """requests: (NativePrefix or None, tokens, params, callbacks) each; one
        tl_generate_batch call. Returns [(emitted, logits or None)] in request order."""
        reqs = self.ffi.new("tl_request[]", len(requests))
        keep: list[Any] = []
        raised: list[BaseException] = []
        outputs: list[tuple[Any, np.ndarray | None]] = []
        for r, (prefix, tokens, params, callbacks) in zip(reqs, requests):
            tokens, buf = self._tokens(tokens)
            keep += [tokens, buf]
            r.size = self.ffi.sizeof("tl_request")
            r.prefix = prefix.handle if prefix is not None else self.ffi.NULL
            r.prompt, r.n_prompt = (buf if len(tokens) else self.ffi.NULL), len(tokens)
            p = self._request_params(params, callbacks, keep, raised)
            out_tokens, logits, out_logits = self._outputs(params, want_logits)
            keep += [p, out_logits]               # the struct fields do not own what they point to
            r.params, r.out_tokens, r.out_logits = p, out_tokens, out_logits
            outputs.append((out_tokens, logits))
        pointers = self.ffi.new("tl_request*[]", [reqs + i for i in range(len(requests))])
        status = self.lib.tl_generate_batch(self.model, pointers, len(requests))
        for r, (_, _, _, callbacks) in zip(reqs, requests):
            self._report_counts(r.params, callbacks)
        self._finish(status, raised)
        return [(list(self.ffi.unpack(out, r.n_out)), list(logits[:r.n_out]) if logits is not None else None)
                for r, (out, logits) in zip(reqs, outputs)]

    def new_scheduler(self, max_batch: int, step_tokens: int,
                      kv_budget_bytes: int) -> NativeScheduler:
        return NativeScheduler(self, max_batch, step_tokens, kv_budget_bytes)

    def cache_stats(self) -> dict[str, int]:
        s = self.ffi.new("tl_prefix_cache_stats*")
        s.size = self.ffi.sizeof("tl_prefix_cache_stats")
        self._check(self.lib.tl_model_prefix_cache_stats(self.model, s))
        return {name: int(getattr(s, name)) for name in CACHE_STAT_NAMES}

    def clear_prefix_cache(self) -> None:
        self._check(self.lib.tl_model_prefix_cache_clear(self.model))

    def close(self) -> None:
        self.lib.tl_model_close(self.model)
