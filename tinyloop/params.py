"""Argument checking, once, before any engine runs: prompts and generation parameters.

Each check raises the error type the API documents (docs/api.md) with a message naming the
argument and the rule it broke, before any backend does work. Backends receive only values
that passed: a `GenerationParams` and an int32 prompt array (both defined by the engine seam,
tinyloop/engine.py, which this module builds on and nothing else in tinyloop but the
ModelConfig type of its hints).
"""
from __future__ import annotations

import math
import numbers
import secrets
from typing import TYPE_CHECKING, Any

import numpy as np

# The request types and the stop rule belong to the engine seam; re-exported for callers.
from .engine import (CACHE_STAT_NAMES, EXIT_DEFAULT_THRESHOLDS, EXIT_RULES, MAX_ARGMAX_STEPS,
                     NO_CALLBACKS,
                     Callbacks, GenerationParams, stop_reached)

if TYPE_CHECKING:
    from .config import ModelConfig

__all__ = ["CACHE_STAT_NAMES", "DEFAULT_N_DRAFT", "MAX_DRAFT", "NO_CALLBACKS", "Callbacks",
           "GenerationParams", "MAX_BLOCK_SIZE", "MAX_LOOPS", "MAX_THREADS",
           "check_cache_salt", "check_draft", "check_exit", "check_int", "check_length", "check_loops",
           "check_prefill_chunk", "check_real", "check_seed", "check_stop_sequences",
           "check_tokens", "generation_params", "stop_reached"]

MAX_LOOPS = 1024
MAX_BLOCK_SIZE = 65536      # KV positions per block (libtinyloop: TL_MAX_KV_BLOCK_SIZE)
MAX_THREADS = 1024          # threads per model (libtinyloop: TL_POOL_MAX_THREADS)
MAX_DRAFT = 64              # tokens drafted per speculative round (libtinyloop: TL_MAX_DRAFT)
DEFAULT_N_DRAFT = 4         # n_draft when only draft_loops is given


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} < {minimum}" if minimum else f"{name} < 0")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def check_real(name: str, value: Any, lower: float, lower_inclusive: bool,
               upper: float = math.inf) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__}")
    number = float(value)
    below = number < lower if lower_inclusive else number <= lower
    if not math.isfinite(number) or below or number > upper:
        bound = f"{'>=' if lower_inclusive else '>'} {lower:g}"
        upper_text = f" and <= {upper:g}" if math.isfinite(upper) else ""
        raise ValueError(f"{name} must be finite and {bound}{upper_text}, got {number!r}")
    return number


def check_loops(loops: Any, default: int) -> int:
    if loops is None:
        return default
    checked = check_int("loops", loops, 1)
    if checked > MAX_LOOPS:
        raise ValueError(f"loops > {MAX_LOOPS}")
    return checked


def check_tokens(name: str, tokens: Any, vocab_size: int) -> np.ndarray:
    """A 1-D sequence of token ids in [0, vocab_size) -> int32 array (a fresh copy)."""
    if isinstance(tokens, (str, bytes, bytearray)):
        raise ValueError(f"{name} must be a 1-D sequence of integer token ids, got {type(tokens).__name__}")
    try:
        arr = np.asarray(tokens)
    except Exception as exc:  # ragged nesting and the like
        raise ValueError(f"{name} must be a 1-D sequence of integer token ids ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got {arr.ndim} dimensions")
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    if arr.dtype == object:
        if not all(_is_int(t) for t in arr):
            raise ValueError(f"{name} must contain only integer token ids")
        arr = np.array([int(t) for t in arr], dtype=object)
    elif arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must contain integer token ids, got dtype {arr.dtype}")
    bad = [i for i, t in enumerate(arr.tolist()) if not 0 <= t < vocab_size] if (
        arr.dtype == object or arr.min() < 0 or arr.max() >= vocab_size) else []
    if bad:
        i = bad[0]
        raise ValueError(f"{name}: token id {arr[i]} at index {i} is out of range [0, {vocab_size})")
    return np.array(arr, dtype=np.int32)


def check_stop_sequences(stop_sequences: Any, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    if stop_sequences is None:
        return ()
    if isinstance(stop_sequences, (str, bytes)) or not hasattr(stop_sequences, "__iter__"):
        raise ValueError("stop_sequences must be a list of token-id sequences")
    result = []
    for i, seq in enumerate(stop_sequences):
        if _is_int(seq):
            raise ValueError("stop_sequences must be a list of token-id sequences, not of ids")
        result.append(tuple(check_tokens(f"stop_sequences[{i}]", seq, vocab_size).tolist()))
    return tuple(result)


def check_seed(seed: Any) -> int:
    if seed is None:
        return secrets.randbits(64)
    if not _is_int(seed) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return int(seed)


def check_cache_salt(salt: Any) -> str:
    """None or a str without NUL characters (it travels to C as a C string)."""
    if salt is None:
        return ""
    if not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a str or None, got {type(salt).__name__}")
    if "\0" in salt:
        raise ValueError("cache_salt must not contain NUL characters")
    return salt


def check_prefill_chunk(chunk: Any, default: int) -> int:
    return default if chunk is None else check_int("prefill_chunk", chunk, 1)


def check_draft(draft_loops: Any, n_draft: Any, loops: int, wave: bool = False
                ) -> tuple[int, int]:
    """Self-speculative decoding's (draft_loops, n_draft) for a request at depth `loops`
    (docs/api.md): draft_loops None (or 0) is off; n_draft None is DEFAULT_N_DRAFT with
    draft_loops (in the wave loops, up to MAX_DRAFT: every draft its pipeline holds), else 0; n_draft 0 is plain decoding, returned as
    (0, 0) whatever draft_loops. In the wave draft_loops "auto" is (0, n_draft): the wave
    chooses the depth (docs/spec.md §5.6.1)."""
    if draft_loops == "auto":
        if not wave:
            raise ValueError("draft_loops='auto' needs draft_wave=True")
        if loops < 2:
            raise ValueError(f"draft_loops='auto' needs loops >= 2, got {loops}")
        depth, n_draft = check_draft(1, n_draft, loops, wave)
        return (0, n_draft) if depth else (0, 0)
    if n_draft is not None:
        if not _is_int(n_draft):
            raise ValueError(f"n_draft must be an integer, got {type(n_draft).__name__}")
        if not 0 <= n_draft <= MAX_DRAFT:
            raise ValueError(f"n_draft must be in 0 .. {MAX_DRAFT}, got {n_draft}")
    draft_loops = 0 if draft_loops is None else check_int("draft_loops", draft_loops, 0)
    if draft_loops == 0:
        if n_draft:
            raise ValueError("n_draft > 0 needs draft_loops")
        return 0, 0
    if n_draft is None:
        n_draft = min(loops, MAX_DRAFT) if wave else DEFAULT_N_DRAFT
    n_draft = int(n_draft)
    if n_draft == 0:
        return 0, 0
    if not 1 <= draft_loops < loops:
        raise ValueError(f"draft_loops must be in 1 .. loops-1 (loops={loops}), got {draft_loops}")
    return draft_loops, n_draft


def check_exit(exit_rule: Any, exit_threshold: Any, min_loops: Any, loops: int, n_draft: int,
               gate_threshold: float | None) -> tuple[str, float, int]:
    """Adaptive depth's (exit_rule, exit_threshold, min_loops) for a request at depth `loops`
    on a model whose exit gate has `gate_threshold` (None: it has none) (docs/spec.md §5.7):
    exit_rule None or "none" is off (then the other two must be None); the threshold defaults
    to gate_threshold ("gate") or EXIT_DEFAULT_THRESHOLDS (the others), min_loops to 1.
    Returns them resolved, the threshold rounded to f32 as every engine reads it."""
    rule = "none" if exit_rule is None else exit_rule
    if rule not in EXIT_RULES:
        raise ValueError(f"exit_rule must be one of {', '.join(map(repr, EXIT_RULES))}, "
                         f"got {exit_rule!r}")
    if rule == "none":
        for name, value in (("exit_threshold", exit_threshold), ("min_loops", min_loops)):
            if value is not None:
                raise ValueError(f"{name} needs an exit_rule")
        return rule, 0.0, 1
    if n_draft:
        raise ValueError("exit_rule cannot be combined with speculative decoding (n_draft > 0)")
    if rule == "gate" and gate_threshold is None:
        raise ValueError("exit_rule 'gate': the model has no exit gate")
    if exit_threshold is None:
        threshold = gate_threshold if rule == "gate" else EXIT_DEFAULT_THRESHOLDS[rule]
    elif rule == "gate":
        threshold = check_real("exit_threshold", exit_threshold, 0.0, False, 1.0)
    elif rule == "argmax":          # a count of steps: an integer, also when given as a float
        steps = exit_threshold
        if isinstance(steps, numbers.Real) and not _is_int(steps) and float(steps).is_integer():
            steps = int(float(steps))
        if not _is_int(steps):
            raise ValueError(f"exit_threshold of exit_rule 'argmax' must be an integer (steps), "
                             f"got {exit_threshold!r}")
        threshold = check_int("exit_threshold", steps, 1, MAX_ARGMAX_STEPS)
    else:
        threshold = check_real("exit_threshold", exit_threshold, 0.0, False)
    minimum = 1 if min_loops is None else check_int("min_loops", min_loops, 1)
    if minimum > loops:
        raise ValueError(f"min_loops must be <= loops ({loops}), got {minimum}")
    return rule, float(np.float32(threshold)), minimum


def generation_params(config: ModelConfig, *, max_tokens: Any, loops: Any, temperature: Any,
                      top_k: Any, top_p: Any, cache_window: Any, repetition_penalty: Any,
                      stop_sequences: Any, seed: Any, prefill_chunk: Any, default_chunk: int,
                      cache_salt: Any = None, draft_loops: Any = None,
                      n_draft: Any = None, draft_wave: Any = False, exit_rule: Any = None,
                      exit_threshold: Any = None, min_loops: Any = None,
                      instruction_length: Any = None) -> GenerationParams:
    """Check every generation argument, in this order (the draft arguments, then the exit
    rule's, last, against the resolved depth); `config` is the model's ModelConfig."""
    checked: dict[str, Any] = dict(
        max_tokens=check_int("max_tokens", max_tokens, 1),
        loops=check_loops(loops, config.default_loops),
        cache_window=check_int("cache_window", cache_window, 0),
        temperature=check_real("temperature", temperature, 0.0, True),
        top_k=check_int("top_k", top_k, 0),
        top_p=check_real("top_p", top_p, 0.0, False, 1.0),
        repetition_penalty=check_real("repetition_penalty", repetition_penalty, 0.0, False),
        stop_sequences=check_stop_sequences(stop_sequences, config.vocab_size),
        seed=check_seed(seed),
        prefill_chunk=check_prefill_chunk(prefill_chunk, default_chunk),
        cache_salt=check_cache_salt(cache_salt),
        instruction_length=check_int("instruction_length",
                                     0 if instruction_length is None else instruction_length, 0),
    )
    if not isinstance(draft_wave, (bool, np.bool_)):
        raise ValueError(f"draft_wave must be a bool, got {type(draft_wave).__name__}")
    draft_loops, n_draft = check_draft(draft_loops, n_draft, checked["loops"], bool(draft_wave))
    rule, threshold, minimum = check_exit(
        exit_rule, exit_threshold, min_loops, checked["loops"], n_draft,
        config.exit_threshold if config.exit_gate else None)
    return GenerationParams(**checked, draft_loops=draft_loops, n_draft=n_draft,
                            draft_wave=bool(draft_wave), exit_rule=rule,
                            exit_threshold=threshold, min_loops=minimum)


def check_instruction(instruction_length: int, n_tokens: int) -> None:
    """An instruction block (docs/spec.md §4.1) lies inside the prompt that starts it."""
    if instruction_length > n_tokens:
        raise ValueError(f"instruction_length {instruction_length} exceeds the prompt's "
                         f"{n_tokens} tokens")


def check_length(n_tokens: int, max_seq_len: int) -> None:
    """The seed's RuntimeError for a sequence that cannot fit the model's context."""
    if n_tokens > max_seq_len:
        raise RuntimeError(f"sequence length {n_tokens} exceeds max_seq_len {max_seq_len}")

