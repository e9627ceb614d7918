"""Prefix-cache planning ledger.

Contract
--------
``PrefixCacheManager(block_size)`` keeps an ordered, duplicate-free set of
registered token prefixes and answers planning questions about prompts:

* ``add_prefix(tokens)`` registers a prefix (an empty prefix is refused with
  ``ValueError``; re-registering an equal prefix is a no-op).
* ``match_prefix(prompt)`` is the length of the longest registered prefix that
  is wholly a prefix of ``prompt`` (0 if none).  It walks a token trie, so it
  costs O(len(prompt)) whatever the number of registered prefixes.
* ``split_prompt(prompt)`` -> ``(reusable_prefix, suffix, hit_len)``.
* ``chunked_prefill_plan(prompt)`` / ``chunked_suffix_prefill_plan(prompt)``
  cut the prompt / the uncached suffix into ``block_size`` tuples (the last
  one may be shorter).
* ``cache_stats(prompt)`` -> ``{'hit_tokens', 'uncached_tokens', 'reuse_ratio'}``.

Token sequences may be lists, tuples, ranges or 1-D array-likes exposing
``tolist()`` (numpy arrays); each token must be a non-negative integer (bools,
floats, strings and nested sequences are refused).  Everything is stored and
returned as plain Python ``int``.  The module is dependency-free: numpy is
handled by duck typing only.

Bound to a model (``PrefixCacheManager(block_size, model=m)``) the ledger holds
real KV: ``add_prefix`` prefills the prefix once (a ``PrefixCache`` pinned for the
manager's life, in ``block_size`` chunks) before registering it, and
``generate(prompt, ...)`` executes the plan: the longest registered prefix is
reused, only the suffix is prefilled, in ``block_size`` chunks, then decoding
runs.  Its tokens equal ``model.generate(prompt, ...)``.  The ledger methods keep
exactly the semantics above.  Without a model it is only a ledger; the
``_make_entry`` hook is where the per-prefix data is built.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

__all__ = ["PrefixCacheManager"]

Tokens = tuple[int, ...]


class _TrieNode:
    """One trie node: children keyed by token; ``index`` of the registered
    prefix ending here (``None`` when no registered prefix ends here)."""

    __slots__ = ("children", "index")

    def __init__(self) -> None:
        self.children: dict[int, _TrieNode] = {}
        self.index: int | None = None


def _is_bool(x: Any) -> bool:
    # Python bool is an int subclass; numpy's bool scalar is named bool_/bool.
    return isinstance(x, bool) or type(x).__name__ in ("bool_", "bool")


def _check_block_size(block_size: Any) -> int:
    if _is_bool(block_size):
        raise TypeError(f"block_size must be an integer, not {type(block_size).__name__}")
    try:
        value = operator.index(block_size)
    except TypeError:
        raise TypeError(
            f"block_size must be an integer, not {type(block_size).__name__}"
        ) from None
    if value <= 0:
        raise ValueError(f"block_size must be a positive integer, got {value}")
    return int(value)


def _as_tokens(tokens: Any, what: str = "tokens") -> Tokens:
    """Validate ``tokens`` and return them as a tuple of plain Python ints.

    Accepts a list, tuple, range or a 1-D array-like with ``tolist()``.
    Raises ``TypeError`` for a wrong container or a non-integer token and
    ``ValueError`` for a non-1-D array or a negative token.
    """
    if hasattr(tokens, "tolist") and hasattr(tokens, "ndim"):
        ndim = tokens.ndim
        if ndim != 1:
            raise ValueError(f"{what} must be a 1-D sequence of token ids, got a {ndim}-D array")
        items = tokens.tolist()  # numpy -> plain Python scalars
    elif isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise TypeError(
            f"{what} must be a sequence of integer token ids, not {type(tokens).__name__}"
        )
    elif isinstance(tokens, Sequence):
        items = tokens
    else:
        raise TypeError(
            f"{what} must be a list, tuple or 1-D integer array of token ids, "
            f"not {type(tokens).__name__}"
        )

    out = []
    for i, tok in enumerate(items):
        if _is_bool(tok):
            raise TypeError(f"{what}[{i}] is a bool, not an integer token id")
        try:
            value = operator.index(tok)
        except TypeError:
            raise TypeError(
                f"{what}[{i}] must be an integer token id, not {type(tok).__name__} ({tok!r})"
            ) from None
        if value < 0:
            raise ValueError(f"{what}[{i}] is a negative token id ({value})")
        out.append(int(value))
    return tuple(out)


class PrefixCacheManager:
    """Ledger of registered token prefixes for prefix-cache planning.

    Parameters
    ----------
    block_size:
        Positive integer; the chunk size used by the ``chunked_*`` plans.
        ``TypeError`` if it is not an integer (bools and floats included),
        ``ValueError`` if it is ``<= 0``.

    Semantics where the design brief is silent:

    * An empty prefix is refused with ``ValueError`` (it can never produce a
      hit and has no KV to hold).
    * Negative token ids are refused with ``ValueError``.
    * An empty prompt is valid: no hit, empty plans, ratio ``0.0``.
    * A prompt equal to a registered prefix is a full hit (empty suffix).
    """

    def __init__(self, block_size: int = 4, *, model: Any = None, loops: int | None = None,
                 cache_window: int = 0) -> None:
        self._block_size = _check_block_size(block_size)
        self._model = model
        self._loops = loops              # depth the prefixes are built at (None: model default)
        self._cache_window = cache_window
        self._prefixes: list[Tokens] = []
        # Per-prefix data built by the ``_make_entry`` hook (None by default).
        self._entries: list[Any] = []
        self._root = _TrieNode()

    # ------------------------------------------------------------------ state

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def model(self) -> Any:
        """The model whose KV the registered prefixes hold, or None (a pure ledger)."""
        return self._model

    @property
    def cached_prefixes(self) -> list[Tokens]:
        """Registered prefixes as tuples, in registration order (a fresh list)."""
        return list(self._prefixes)

    @property
    def chunked_prefixes(self) -> list[list[Tokens]]:
        """Each registered prefix cut into ``block_size`` tuples, same order."""
        return [self._chunk(p) for p in self._prefixes]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self._block_size}, prefixes={len(self._prefixes)})"

    # ---------------------------------------------------------- registration

    def add_prefix(self, tokens: Any) -> bool:
        """Register ``tokens`` as a cached prefix.

        Returns ``True`` if the prefix was newly registered and ``False`` if an
        equal prefix was already registered (duplicates are ignored).  An empty
        prefix raises ``ValueError``; bad tokens raise ``TypeError`` /
        ``ValueError``.  If the ``_make_entry`` hook raises, nothing is
        registered.
        """
        key = _as_tokens(tokens, "prefix")
        if not key:
            raise ValueError("prefix must contain at least one token")

        # Find (or plan) the terminal node without mutating the trie yet.
        node: _TrieNode | None = self._root
        for tok in key:
            if node is None:
                break
            node = node.children.get(tok)
        if node is not None and node.index is not None:
            return False  # duplicate

        index = len(self._prefixes)
        entry = self._make_entry(key, index)  # may raise: ledger unchanged

        node = self._root
        for tok in key:
            child = node.children.get(tok)
            if child is None:
                child = node.children[tok] = _TrieNode()
            node = child
        node.index = index
        self._prefixes.append(key)
        self._entries.append(entry)
        return True

    def _make_entry(self, prefix: Tokens, index: int) -> Any:
        """Extension hook: build the data held for a newly registered prefix.

        Called by ``add_prefix`` with the validated prefix (tuple of ints) and
        the index it will get in ``cached_prefixes``, *before* anything is
        committed; raising aborts the registration.  The return value is
        stored in ``self._entries[index]``.  Without a model the ledger holds
        nothing (``None``); with one, the prefix's ``PrefixCache``.
        """
        if self._model is None:
            return None
        return self._model.build_prefix_cache(list(prefix), loops=self._loops,
                                              cache_window=self._cache_window,
                                              prefill_chunk=self._block_size)

    def prefix_cache(self, index: int) -> Any:
        """The ``PrefixCache`` of ``cached_prefixes[index]`` (model-bound managers)."""
        self._require_model()
        return self._entries[index]

    def _require_model(self) -> None:
        if self._model is None:
            raise RuntimeError("this PrefixCacheManager has no model; pass model= to hold KV")

    # -------------------------------------------------------------- execution

    def generate(self, prompt: Any, **kwargs: Any) -> list[int]:
        """Run ``prompt`` through the plan and generate (``kwargs`` as for
        ``Model.generate``, ``prefill_chunk`` excepted: it is ``block_size``).

        The longest registered prefix is reused, the suffix prefilled in
        ``block_size`` chunks; returns exactly ``model.generate(prompt, ...)``. A
        request with an ``instruction_length`` reuses none (the registered prefixes
        are causal: docs/spec.md §4.1).
        """
        self._require_model()
        if "prefill_chunk" in kwargs:
            raise TypeError("prefill_chunk is the manager's block_size")
        toks = _as_tokens(prompt, "prompt")
        hit, index = self._longest_match(toks)
        instruction = kwargs.pop("instruction_length", 0)
        if index is None or instruction:
            tokens: list[int] = self._model.generate(list(toks), prefill_chunk=self._block_size,
                                                     instruction_length=instruction, **kwargs)
        else:
            tokens = self._model.generate_from_prefix_cache(
                self._entries[index], suffix=list(toks[hit:]), prefill_chunk=self._block_size,
                **kwargs)
        return tokens

    # --------------------------------------------------------------- queries

    def _longest_match(self, prompt: Tokens) -> tuple[int, int | None]:
        """Walk the trie along ``prompt`` (already validated).

        Returns ``(hit_len, index)`` where ``index`` is the position in
        ``cached_prefixes`` of the longest registered prefix of ``prompt``
        (``None`` and ``hit_len == 0`` if there is none).  O(len(prompt)).
        """
        node = self._root
        hit_len, hit_index = 0, None
        for depth, tok in enumerate(prompt, 1):
            child = node.children.get(tok)
            if child is None:
                break
            node = child
            if node.index is not None:
                hit_len, hit_index = depth, node.index
        return hit_len, hit_index

    def match_prefix(self, prompt: Any) -> int:
        """Length of the longest registered prefix that is wholly a prefix of
        ``prompt``; 0 if none (a registered prefix longer than the prompt never
        matches)."""
        return self._longest_match(_as_tokens(prompt, "prompt"))[0]

    def split_prompt(self, prompt: Any) -> tuple[list[int], list[int], int]:
        """Return ``(reusable_prefix, suffix, hit_len)`` as lists of ints, with
        ``reusable_prefix + suffix == list(prompt)`` and
        ``hit_len == len(reusable_prefix)``."""
        toks = _as_tokens(prompt, "prompt")
        hit, _ = self._longest_match(toks)
        return list(toks[:hit]), list(toks[hit:]), hit

    def chunked_prefill_plan(self, prompt: Any) -> list[Tokens]:
        """The whole prompt cut into ``block_size`` tuples (short tail kept)."""
        return self._chunk(_as_tokens(prompt, "prompt"))

    def chunked_suffix_prefill_plan(self, prompt: Any) -> list[Tokens]:
        """Only the uncached suffix cut into ``block_size`` tuples; ``[]`` on a
        full hit (or an empty prompt)."""
        toks = _as_tokens(prompt, "prompt")
        hit, _ = self._longest_match(toks)
        return self._chunk(toks[hit:])

    def cache_stats(self, prompt: Any) -> dict[str, int | float]:
        """``{'hit_tokens', 'uncached_tokens', 'reuse_ratio'}`` for ``prompt``;
        ``reuse_ratio = round(hit / len(prompt), 4)``, ``0.0`` for an empty
        prompt."""
        toks = _as_tokens(prompt, "prompt")
        hit, _ = self._longest_match(toks)
        n = len(toks)
        return {
            "hit_tokens": hit,
            "uncached_tokens": n - hit,
            "reuse_ratio": round(hit / n, 4) if n else 0.0,
        }

    # --------------------------------------------------------------- helpers

    def _chunk(self, toks: Tokens) -> list[Tokens]:
        b = self._block_size
        return [toks[i:i + b] for i in range(0, len(toks), b)]
