"""The Python engine: sequences, chunked prefill, decode, generation and prefixes.

One engine serves every Python backend; its arithmetic comes from a kernel set
(fallback/forward.py). With `NumpyKernels` it is the numpy backend, the executable form of
docs/spec.md. `Engine` implements the engine interface, tinyloop.engine.Engine: callers
(tinyloop.Model) pass only checked arguments, int32 prompts with ids in range and a
tinyloop.engine.GenerationParams.
"""
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from tinyloop.engine import CACHE_STAT_NAMES, NO_CALLBACKS, loops_mismatch, stop_reached

from . import hidden_prefix, prefix_blob
from .exit_rules import exit_rule
from .forward import NumpyKernels, decode_pass, forward_chunk, forward_part, head_logits, on_host
from .kvcache import KV_BITS, KVCache, chunk_bounds
from .pcache_disk import DiskTier
from .prefix_cache import PrefixCache
from .scheduler import Scheduler
from .speculate import speculative_round
from .weights import Weights


@dataclass
class Prefix:
    """A prompt's KV at depth `loops` (the coda slots of every depth written) plus the last
    token's final state (the head's input) at every depth 1 .. loops (docs/spec.md §5.4).
    A warm-start prefix also keeps every token's state after iteration loops-1 and, with
    injection, its injected term (a two-state core: its low state), so that Engine.extend_prefix can deepen it; one loaded from
    the blob of a backend without a part pass has no states, and is rebuilt to deepen it.
    A hidden-state prefix (§5.4.1) holds no KV (cache None) but each layer's input rows
    (hidden), from which every sequence starting from it rebuilds its own KV."""
    engine: "Engine" = field(repr=False)    # the engine that built or loaded it
    tokens: np.ndarray          # (n,) int32
    loops: int
    cache_window: int
    cache: Optional[KVCache]    # None for an h prefix
    loop_states: list = field(repr=False)   # depth 1 .. loops: (1, d) f32, the kernels' arrays
    warm_start: bool = False
    states: Optional[np.ndarray] = field(default=None, repr=False)     # warm start: (n, d) f32
    injected: Optional[np.ndarray] = field(default=None, repr=False)   # and carried: (n, d) f32
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)   # extend vs fork
    hidden: Optional[hidden_prefix.HiddenRows] = field(default=None, repr=False)   # h prefix
    instruction: int = 0        # its instruction length P (spec §4.1), 0 .. n

    @property
    def storage(self):
        return "kv" if self.hidden is None else self.hidden.storage

    @property
    def nbytes(self):
        """KV blocks held (an h prefix: its rows instead), plus the loop states, the token
        copy and a warm start's states (docs/api.md)."""
        kept = sum(a.nbytes for a in (self.states, self.injected) if a is not None)
        held = self.cache.nbytes if self.hidden is None else self.hidden.nbytes
        return held + 4 * self.loops * self.loop_states[0].shape[1] + 4 * len(self.tokens) + kept

    def free(self):
        if self.cache is not None:
            self.cache.free()

    def to_bytes(self):
        """The prefix blob (docs/spec.md §7), safe beside an extension of this prefix."""
        with self.lock:
            return prefix_blob.save(self.engine, self)


class Engine:
    """A model's weights and KV pool, run by one kernel set (NumpyKernels by default), with an
    automatic prefix cache of `prefix_cache_bytes` (0: none), backed by the disk tier in
    `prefix_cache_dir` (None: none; checked by the caller) under `prefix_cache_disk_bytes`
    (0: no limit); kv_mode "int8" or "int4" is
    how the pool stores keys and values; model_identity is the model file's (header checksum,
    file_bytes), what its prefix blobs name it by."""

    def __init__(self, config, tensors, block_size=16, kernels=NumpyKernels, prefix_cache_bytes=0,
                 kv_mode="int8", *, model_identity, prefix_cache_dir=None,
                 prefix_cache_disk_bytes=0):
        self.config = config
        self.model_identity = model_identity
        self.kernels = kernels
        self.kv_mode = kv_mode
        self.weights = Weights(config, tensors, kernels.linear, kernels.table)
        self.pool = kernels.new_pool(block_size, config.n_kv_heads, config.head_dim,
                                     KV_BITS[kv_mode])
        disk = None if prefix_cache_dir is None else DiskTier(
            prefix_cache_dir, prefix_cache_disk_bytes, config, self.pool, kernels.to_host,
            model_identity)
        self.prefix_cache = (PrefixCache(self.pool, prefix_cache_bytes, disk)
                             if prefix_cache_bytes else None)

    def runtime(self):
        """tinyloop.engine.RUNTIME_KEYS, from the kernel set (its name, device and kernel
        path) and the weights as it holds them, on the host or on its device."""
        k, held = self.kernels, self.weights.nbytes
        host, device = (held, 0) if k.device == "cpu" else (0, held)
        return {"backend": k.name, "device": k.device, "device_name": k.device_name,
                "isa": k.isa, "threads": k.threads, "kv_block_size": self.pool.block_size,
                "weight_bytes": host, "device_weight_bytes": device, "kv_mode": self.kv_mode}

    def new_cache(self, loops, window, instruction=0):
        return KVCache(self.pool, self.config.n_layers(loops), window, instruction)

    def prefill(self, cache, tokens, chunk, depth_states=None, all_logits=False, release=True,
                on_chunk=None, kept=None, capture=None):
        """Feed tokens in chunks; returns logits (V,) of the last token, or (n, V) of all.
        depth_states: a list to receive the last token's final state at every depth, and the
        coda's KV of every depth (a prefix build, forward_chunk); release=False keeps the
        blocks a window no longer sees (for the prefix cache); on_chunk(tokens done in this
        call) runs after each chunk; kept: a list to receive each chunk's Rows; capture: an h
        prefix build's recorder of every layer's input (forward_part)."""
        outputs = []
        for start, stop in chunk_bounds(cache.length, len(tokens), chunk, cache.instruction):
            piece = tokens[start:stop]
            states = [] if depth_states is not None else None
            rows = forward_chunk(self.kernels, self.weights, cache, piece, states, capture)
            x = rows.hidden
            if kept is not None:
                kept.append(rows)
            if depth_states is not None and stop == len(tokens):
                depth_states.extend(states)
            if all_logits:
                outputs.append(head_logits(self.kernels, self.weights, x))
            if on_chunk is not None:
                on_chunk(stop)
        if release:
            cache.release_outside_window()
        if all_logits:
            return np.concatenate(outputs)
        return head_logits(self.kernels, self.weights, self.kernels.last_row(x))[0]

    def logits(self, tokens, loops, window, chunk, instruction=0):
        cache = self.new_cache(loops, window, instruction)
        try:
            return self.prefill(cache, tokens, chunk, all_logits=True)
        finally:
            cache.free()

    def generate(self, prompt, params, want_logits=False, callbacks=NO_CALLBACKS):
        """Returns (emitted ids, per-step logits); the logits are kept whatever want_logits says.
        callbacks.on_token(id) runs after each emitted token, callbacks.on_prefill(done, total)
        after each prompt chunk; if one raises, generation stops and the exception propagates."""
        cache = self.new_cache(params.loops, params.cache_window, params.instruction_length)
        try:
            logits = self._run_prompt(cache, prompt, params, callbacks.on_prefill)
        except BaseException:
            cache.free()
            raise
        return self._decode(cache, logits, list(prompt.tolist()), params, callbacks)

    @staticmethod
    def _progress(on_prefill, done_before, total):
        """An on_chunk reporting to on_prefill(done, total), or None."""
        if on_prefill is None:
            return None
        return lambda done: on_prefill(done_before + done, total)

    def _run_prompt(self, cache, prompt, params, on_prefill):
        """Prefill the prompt into the empty cache, reusing the longest cached prefix of it."""
        if self.prefix_cache is None:
            return self.prefill(cache, prompt, params.prefill_chunk,
                                on_chunk=self._progress(on_prefill, 0, len(prompt)))
        tree = self._tree(params)
        hit = self.prefix_cache.lookup(tree, cache, prompt)
        logits = self.prefill(cache, prompt[hit:], params.prefill_chunk, release=False,
                              on_chunk=self._progress(on_prefill, hit, len(prompt)))
        self.prefix_cache.insert(tree, cache, prompt)
        cache.release_outside_window()
        return logits

    def _tree(self, params):
        """The prefix cache's tree of a request (docs/spec.md §4.3): per (salt, window,
        instruction length), and per depth too when the model has a coda (its slots hold one
        depth's KV)."""
        tree = (params.cache_salt, params.cache_window, params.instruction_length)
        return tree + (params.loops,) if self.config.n_coda_blocks else tree

    def generate_batch(self, requests, want_logits=False):
        """requests: (prefix or None, tokens, params, callbacks) each. The reference runs them
        one after another: batching changes no result, only speed. Returns [(emitted, logits)]."""
        return [self.generate_from_prefix(prefix, tokens, params, callbacks=callbacks) if prefix is not None
                else self.generate(tokens, params, callbacks=callbacks)
                for prefix, tokens, params, callbacks in requests]

    def new_scheduler(self, max_batch, step_tokens, kv_budget_bytes):
        return Scheduler(self, max_batch, step_tokens, kv_budget_bytes)

    def cache_stats(self):
        return self.prefix_cache.stats() if self.prefix_cache is not None else dict.fromkeys(CACHE_STAT_NAMES, 0)

    def clear_prefix_cache(self):
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def build_prefix(self, prompt, loops, window, chunk, warm_start=False, storage="kv",
                     instruction=0):
        """A prefix of `storage` "kv", "h8" or "h4" (docs/spec.md §5.4.1; ValueError when the
        storage cannot be built: hidden_prefix.check_storage) whose first `instruction`
        tokens are an instruction block (§4.1)."""
        hidden_prefix.check_storage(self.config, self.pool.kv_bits, storage, warm_start)
        cache = self.new_cache(loops, window, instruction)
        states, kept = [], [] if warm_start else None
        hidden = capture = None
        if storage != "kv":
            hidden = hidden_prefix.HiddenRows.empty(storage, cache.n_layers, self.config.d_model,
                                                    len(prompt), window)
            capture = hidden_prefix.recorder(hidden, self.kernels, self.config.rms_eps)
        try:
            self.prefill(cache, prompt, chunk, depth_states=states, kept=kept, capture=capture)
        except BaseException:
            cache.free()
            raise
        if hidden is not None:
            cache.free()                 # at rest an h prefix keeps its rows, not its KV
            cache = None
        prefix = Prefix(self, prompt.copy(), loops, window, cache, states, warm_start,
                        hidden=hidden, instruction=instruction)
        if warm_start:
            prefix.states = on_host(self.kernels, [rows.state for rows in kept])
            if self.config.carries_injected:
                prefix.injected = on_host(self.kernels, [rows.injected for rows in kept])
        return prefix

    def extend_prefix(self, prefix, loops, chunk):
        """Deepen a warm-start prefix to depth `loops` in place (docs/spec.md §5.4): iterations
        prefix.loops .. loops-1 for every prefix token, `chunk` tokens a pass, from the kept
        states, into new cache slots; the old slots are shared, not copied. Bit-identical to a
        prefix built at `loops`. A no-op when the prefix is that deep already."""
        with prefix.lock:
            if loops <= prefix.loops:
                return
            if not prefix.warm_start:
                raise RuntimeError(loops_mismatch(prefix.loops, loops))
            if prefix.states is None or self._lost_iteration_zero(prefix):
                self._rebuild(prefix, loops, chunk)
                return
            k, n, n_old = self.kernels, len(prefix.tokens), self.config.n_layers(prefix.loops)
            cache = self.new_cache(loops, prefix.cache_window, prefix.instruction)
            fresh = cache.layers[n_old:]
            cache.layers[:n_old] = prefix.cache.layers
            kept, carried = [], []
            try:
                for start, stop in chunk_bounds(0, n, chunk, prefix.instruction):
                    rows = slice(start, stop)
                    states = []
                    part = forward_part(k, self.weights, cache, start, first_iter=prefix.loops,
                                        state=k.table(prefix.states[rows]),
                                        injected=None if prefix.injected is None
                                        else k.table(prefix.injected[rows]),
                                        depth_states=states)
                    kept.append(part.state)
                    carried.append(part.injected)
                cache.length = n
                cache.release_outside_window()
                deeper = on_host(k, kept)
                # a two-state core's low states move on too; injected terms stay the same
                injected = on_host(k, carried) if self.config.core_cycles else prefix.injected
            except BaseException:
                cache.layers = fresh         # the prefix's own slots stay the prefix's
                cache.free()
                raise
            prefix.cache, prefix.states, prefix.injected = cache, deeper, injected
            prefix.loop_states = prefix.loop_states + states
            prefix.loops = loops

    def _lost_iteration_zero(self, prefix):
        """Whether the window released blocks whose iteration-0 KV the prefix's extension would
        read: with loop attention (docs/spec.md §4) every later iteration of an old position
        attends over iteration 0's keys near it."""
        return bool(self.config.loop_window) and any(
            blk is None for blocks in prefix.cache.layers for blk in blocks)

    def _rebuild(self, prefix, loops, chunk):
        """Deepen a warm-start prefix by building it again at `loops`: one that kept no states,
        or with loop attention under a window, whose released iteration-0 keys the new
        iterations would read (docs/spec.md §5.4)."""
        deeper = self.build_prefix(prefix.tokens, loops, prefix.cache_window, chunk, True,
                                   instruction=prefix.instruction)
        prefix.cache.free()     # generations running from it keep their forks' blocks
        prefix.cache, prefix.loop_states = deeper.cache, deeper.loop_states
        prefix.states, prefix.injected, prefix.loops = deeper.states, deeper.injected, loops

    def prefix_from_bytes(self, blob):
        """The prefix a blob of Prefix.to_bytes (or libtinyloop's tl_prefix_save) holds;
        PrefixFormatError for a corrupted one or one of another model or KV mode."""
        return Prefix(self, **prefix_blob.load(self, blob))

    def generate_from_prefix(self, prefix, suffix, params, want_logits=False, callbacks=NO_CALLBACKS):
        """Feed `suffix` (possibly empty) after a prefix, then decode, at depth
        params.loops <= prefix.loops (checked by the caller). An h prefix's KV is rebuilt
        into the sequence's own cache (its rows never change: no lock)."""
        if prefix.hidden is not None:
            cache = hidden_prefix.rebuild(self, prefix.hidden, params.loops, prefix.cache_window,
                                          params.prefill_chunk, prefix.instruction)
            loop_state = prefix.loop_states[params.loops - 1]
        else:
            with prefix.lock:
                cache = prefix.cache.fork(self.config.n_layers(params.loops))
                loop_state = prefix.loop_states[params.loops - 1]
        n = len(prefix.tokens)
        try:
            if len(suffix):
                logits = self.prefill(cache, suffix, params.prefill_chunk, on_chunk=self._progress(
                    callbacks.on_prefill, n, n + len(suffix)))
            else:
                logits = head_logits(self.kernels, self.weights, loop_state)[0]
        except BaseException:
            cache.free()
            raise
        history = prefix.tokens.tolist() + suffix.tolist()
        return self._decode(cache, logits, history, params, callbacks)

    def _decode(self, cache, logits, history, params, callbacks):
        """Sample until a stop rule fires, decoding plainly or, with params.n_draft > 0, in
        speculative rounds (docs/spec.md §5.6), each reported to callbacks.on_draft. Returns
        (emitted ids, [(V,) logits per emitted id]); frees the cache."""
        emitted, step_logits = [], []
        stop_ids = self.config.stop_token_ids()

        def emit(token, z):
            step_logits.append(z)
            history.append(token)
            emitted.append(token)
            if callbacks.on_token is not None:
                callbacks.on_token(token)
            return stop_reached(emitted, params, stop_ids)

        k, w = self.kernels, self.weights
        rule = exit_rule(params, w)
        try:
            done = emit(k.sample(logits, history, params, len(history)), logits)
            while not done:
                if params.n_draft:
                    counts = speculative_round(k, w, cache, history, params, emit,
                                               params.max_tokens - len(emitted))
                    if callbacks.on_draft is not None:
                        callbacks.on_draft(*counts)
                    done = stop_reached(emitted, params, stop_ids)
                else:
                    x, depth = decode_pass(k, w, cache, history[-1], rule)
                    if callbacks.on_depth is not None:
                        callbacks.on_depth(1, depth)
                    cache.release_outside_window()
                    logits = head_logits(k, w, x)[0]
                    done = emit(k.sample(logits, history, params, len(history)), logits)
            return emitted, step_logits
        finally:
            cache.free()

    def close(self):
        """Spill the prefix cache to its disk tier, if any, and release the model."""
        if self.prefix_cache is not None:
            self.prefix_cache.close()
        self.weights = None
