"""Benchmarks shared by `tinyloop bench` and the scripts in bench/: the standard shapes, prefill
and decode speed, and the seed's shared-prefix experiment. Every figure comes from one process,
and comparisons are ratios of runs made side by side (these machines are shared and noisy).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar, cast

import numpy as np

from .random_model import random_model

if TYPE_CHECKING:
    from .model import Model, PrefixCache, TokenIds

T = TypeVar("T")

# The shapes every bench and issue refers to (n_pre 2, L 8, vocab 32000): ModelConfig keyword
# arguments (for random_model's **overrides, hence Any).
SHAPES: dict[str, dict[str, Any]] = {
    "quick": dict(vocab_size=32000, d_model=512, n_heads=8, n_kv_heads=8, head_dim=64,
                  ffn_dim=1408, n_pre_blocks=2, default_loops=8, max_seq_len=2048),
    "full": dict(vocab_size=32000, d_model=2048, n_heads=16, n_kv_heads=16, head_dim=128,
                 ffn_dim=5632, n_pre_blocks=2, default_loops=8, max_seq_len=2048),
}


def backend_kwargs(name: str) -> dict[str, str]:
    """Model keyword arguments for a backend name of the benches and tests: one of
    tinyloop.BACKENDS, or "native-cuda" = the native backend with device="cuda"."""
    return {"backend": "native", "device": "cuda"} if name == "native-cuda" else {"backend": name}


def quiet(stage: str) -> None:
    """The default `progress` of the functions below: says nothing."""


def describe(config: Mapping[str, Any]) -> str:
    """One line naming a model and its shape, from Model.config()."""
    return (f"{config['name'] or 'unnamed'}: d_model {config['d_model']}, "
            f"{config['n_pre_blocks']} pre block(s) + loop block x {config['default_loops']}, "
            f"{config['weight_format']}, vocab {config['vocab_size']}")


def bench_model(shape: str, weight_format: str, directory: str | os.PathLike[str],
                progress: Callable[[str], None] = quiet) -> Path:
    """Path of a random model of a standard shape, written once into `directory` (or into
    TINYLOOP_BENCH_MODELS when that is set, so several benches share one file).
    progress(text) is called before the file is written."""
    directory = os.environ.get("TINYLOOP_BENCH_MODELS") or directory
    path = Path(directory) / f"{shape}-{weight_format}.tinyloop"
    if not path.exists():
        progress(f"writing a random {shape}-shape {weight_format} model to {path}")
        random_model(path, seed=0, weight_format=weight_format,
                     name=f"bench-{shape}-{weight_format}", **SHAPES[shape])
    return path


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """(fn(), wall seconds)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def best_of(fn: Callable[[], T], repeats: int) -> tuple[T | None, float]:
    """(result, fastest wall time in seconds) over `repeats` runs."""
    best, result = float("inf"), None
    for _ in range(repeats):
        result, seconds = timed(fn)
        best = min(best, seconds)
    return result, best


def median_of(fn: Callable[[], T], repeats: int) -> tuple[T, float]:
    """(result, median wall time in seconds) over `repeats` runs."""
    runs = [timed(fn) for _ in range(repeats)]
    return runs[-1][0], float(np.median([seconds for _, seconds in runs]))


def speed(model: Model, n_prefill: int = 512, n_decode: int = 32, repeats: int = 1,
          progress: Callable[[str], None] = quiet) -> tuple[list[int] | None, float, float]:
    """(tokens, prefill tok/s, decode tok/s): a prefix of n_prefill random tokens built in one
    chunk, then n_decode greedy steps from it; progress(text) before each of the two."""
    prompt = np.random.default_rng(1).integers(0, model.config()["vocab_size"], n_prefill)
    progress(f"prefill speed: {n_prefill} tokens in one chunk, best of {repeats}")
    prefix, t_prefill = best_of(lambda: model.build_prefix_cache(prompt, prefill_chunk=n_prefill),
                                repeats)
    prefix = cast("PrefixCache", prefix)    # None only for repeats < 1, when it goes unused
    progress(f"decode speed: {n_decode} greedy tokens, best of {repeats}")
    tokens, t_decode = best_of(lambda: model.generate_from_prefix_cache(prefix, max_tokens=n_decode),
                               repeats)
    return tokens, n_prefill / t_prefill, n_decode / t_decode


def shared_prefix(model: Model, prompt: TokenIds, n: int, max_tokens: int = 32,
                  loops: int = 8, progress: Callable[[str], None] = quiet) -> dict[str, float]:
    """The seed's table row for N requests sharing `prompt` (model without automatic cache).

    NO_CACHE: each request runs the whole prompt. SHARED: one PrefixCache, N continuations in
    turn. BATCHED: one PrefixCache, the N continuations in one generate_batch. BOUND:
    (P + D) / (P / N + D) from the prefill time P and decode time D (medians of 3 runs), the
    best SHARED can reach. Greedy; `same tokens` checks that the three ways agree.
    progress(text) is called before each of the five stages."""
    kw: dict[str, Any] = dict(max_tokens=max_tokens, loops=loops, temperature=0.0)
    progress(f"bound: prefill of the {len(prompt)}-token prompt, 3 runs")
    prefix, t_prefill = median_of(lambda: model.build_prefix_cache(prompt, loops=loops), 3)
    progress(f"bound: {max_tokens} tokens decoded from it, 3 runs")
    alone, t_decode = median_of(lambda: model.generate_from_prefix_cache(prefix, **kw), 3)
    progress(f"no_cache: {n} requests, each running the whole prompt")
    no_cache, t_none = timed(lambda: [model.generate(prompt, **kw) for _ in range(n)])

    def shared() -> list[list[int]]:
        p = model.build_prefix_cache(prompt, loops=loops)
        return [model.generate_from_prefix_cache(p, **kw) for _ in range(n)]

    def batched() -> list[list[int]]:
        p = model.build_prefix_cache(prompt, loops=loops)
        return model.generate_batch([[]] * n, prefix=p, **kw)

    progress(f"shared: one PrefixCache, {n} continuations in turn")
    shared_out, t_shared = timed(shared)
    progress(f"batched: one PrefixCache, {n} continuations in one generate_batch")
    batched_out, t_batched = timed(batched)
    bound = (t_prefill + t_decode) / (t_prefill / n + t_decode)
    return {"prefix": len(prompt), "N": n, "no_cache s": t_none, "shared s": t_shared,
            "batched s": t_batched, "shared x": t_none / t_shared, "bound x": bound,
            "shared/bound": (t_none / t_shared) / bound, "batched x": t_none / t_batched,
            "same tokens": no_cache == shared_out == batched_out and shared_out[0] == alone}
