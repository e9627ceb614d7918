"""The numpy backend: sequences, chunked prefill, decode, generation and prefixes.

This is the executable form of docs/spec.md. Callers (tinyloop.Model) pass only checked
arguments: int32 prompts with ids in range and a tinyloop.params.GenerationParams.
"""
from dataclasses import dataclass, field

import numpy as np

from tinyloop.params import stop_reached

from .forward import forward_chunk, head_logits
from .kvcache import BlockPool, KVCache
from .sampling import sample
from .weights import Weights


@dataclass
class Prefix:
    """A prompt's KV at depth `loops` plus the last token's state after every loop iteration."""
    tokens: np.ndarray          # (n,) int32
    loops: int
    cache_window: int
    cache: KVCache
    loop_states: list = field(repr=False)   # loops x (d,) float32

    @property
    def nbytes(self):
        return self.cache.nbytes

    def free(self):
        self.cache.free()


class NumpyEngine:
    name = "numpy"

    def __init__(self, config, tensors, block_size=16):
        self.config = config
        self.weights = Weights(config, tensors)
        self.pool = BlockPool(block_size, config.n_kv_heads, config.head_dim)

    def new_cache(self, loops, window):
        return KVCache(self.pool, self.config.n_pre_blocks + loops, window)

    def prefill(self, cache, tokens, chunk, layer_states=None, all_logits=False):
        """Feed tokens in chunks; returns logits (V,) of the last token, or (n, V) of all."""
        outputs = []
        for start in range(0, len(tokens), chunk):
            piece = tokens[start:start + chunk]
            states = [] if layer_states is not None else None
            x = forward_chunk(self.weights, cache, piece, states)
            if layer_states is not None and start + chunk >= len(tokens):
                layer_states.extend(states)
            if all_logits:
                outputs.append(head_logits(self.weights, x))
        if all_logits:
            return np.concatenate(outputs)
        return head_logits(self.weights, x[-1:])[0]

    def logits(self, tokens, loops, window, chunk):
        cache = self.new_cache(loops, window)
        try:
            return self.prefill(cache, tokens, chunk, all_logits=True)
        finally:
            cache.free()

    def generate(self, prompt, params):
        cache = self.new_cache(params.loops, params.cache_window)
        logits = self.prefill(cache, prompt, params.prefill_chunk)
        return self._decode(cache, logits, list(prompt.tolist()), params)

    def build_prefix(self, prompt, loops, window, chunk):
        cache = self.new_cache(loops, window)
        states = []
        self.prefill(cache, prompt, chunk, layer_states=states)
        return Prefix(prompt.copy(), loops, window, cache, states)

    def generate_from_prefix(self, prefix, suffix, params):
        """Feed `suffix` (possibly empty) after a prefix, then decode, at depth
        params.loops <= prefix.loops (checked by the caller)."""
        cache = prefix.cache.fork(self.config.n_pre_blocks + params.loops)
        if len(suffix):
            logits = self.prefill(cache, suffix, params.prefill_chunk)
        else:
            x = prefix.loop_states[params.loops - 1][None, :]
            logits = head_logits(self.weights, x)[0]
        history = prefix.tokens.tolist() + suffix.tolist()
        return self._decode(cache, logits, history, params)

    def _decode(self, cache, logits, history, params):
        """Sample until a stop rule fires. Returns (emitted ids, [(V,) logits per emitted id])."""
        emitted, step_logits = [], []
        try:
            while True:
                token = sample(logits, history, params, len(history))
                step_logits.append(logits)
                history.append(token)
                emitted.append(token)
                if stop_reached(emitted, params, self.config.eos_id):
                    return emitted, step_logits
                x = forward_chunk(self.weights, cache, np.array([token], np.int32))
                logits = head_logits(self.weights, x)[0]
        finally:
            cache.free()

    def close(self):
        self.weights = None
