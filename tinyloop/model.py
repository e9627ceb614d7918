"""`Model` and `PrefixCache`: the public face of TinyLoop (docs/api.md).

A Model owns one engine (the interface of tinyloop/engine.py; tinyloop.backends picks and opens
it) and names no backend itself. Every public call checks its arguments here, once, with the
error types the API documents, then hands the engine only valid values. The seed contract's
error phrases ("model was closed", "loops mismatch", "max_tokens < 1", ...) are kept verbatim.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import (Any, Callable, Iterator, List, Literal, Mapping, MutableMapping, Sequence,
                    Tuple, Union, overload)

import numpy as np
import numpy.typing as npt

from . import params as P
from .backends import open_engine
from .bundled import demo_model_path
from .engine import (Callbacks, Engine, EnginePrefix, GenerationParams,
                     check_prefix_storage, loops_mismatch)
from .modelfile import read_meta
from .tokenizer import Tokenizer, open_tokenizer

KV_MODES = ("int8", "int4")
DEFAULT_PREFILL_CHUNK = 512
DEFAULT_PREFIX_CACHE_BYTES = 256 << 20
# Token ids as the API takes them: a sequence of ints or a 1-D integer array.
TokenIds = Union[Sequence[int], np.ndarray]
# What a generation returns with return_logits=True: the ids and the float32 logits
# (n_emitted, vocab_size) each emitted token was sampled from.
IdsAndLogits = Tuple[List[int], npt.NDArray[np.float32]]
# A checked request: (all tokens, the tokens to run, its parameters).
CheckedRequest = Tuple[np.ndarray, np.ndarray, GenerationParams]
# The keyword arguments of a generation request (generate_batch's `params` and `per_request`).
REQUEST_ARGUMENTS = ("max_tokens", "loops", "temperature", "top_k", "top_p", "cache_window",
                     "repetition_penalty", "stop_sequences", "seed", "prefill_chunk", "cache_salt",
                     "draft_loops", "n_draft", "draft_stats", "exit_rule", "exit_threshold",
                     "min_loops", "depth_stats", "instruction_length")


def _env_flag(var: str) -> bool:
    return os.environ.get(var, "0") not in ("", "0")


def _check_kv_mode(kv_mode: str | None) -> str:
    """The KV mode a Model runs in: kv_mode itself ("int8" or "int4"), or for None "int4"
    when TINYLOOP_KV_INT4 is set (not "" or "0"), else "int8"."""
    if kv_mode is None:
        return "int4" if _env_flag("TINYLOOP_KV_INT4") else "int8"
    if kv_mode not in KV_MODES:
        raise ValueError(f"kv_mode {kv_mode!r} is not supported; use one of "
                         f"{', '.join(map(repr, KV_MODES))}")
    return kv_mode


def _check_prefix_storage(prefix_storage: str | None, kv_mode: str) -> str:
    """What a Model's prefixes keep by default (docs/api.md, "Hidden-state prefixes"):
    prefix_storage itself ("kv", "h8" or "h4"), or for None the seed's TINYLOOP_KV_H_MODE:
    unset, "" or "0" "kv"; "1" the smallest, "h4" in the int4 KV mode, else "h8"; "h8" or
    "h4" that one."""
    if prefix_storage is not None:
        return check_prefix_storage(prefix_storage, "prefix_storage")
    mode = os.environ.get("TINYLOOP_KV_H_MODE", "")
    if mode in ("", "0"):
        return "kv"
    if mode == "1":
        return "h4" if kv_mode == "int4" else "h8"
    if mode in ("h8", "h4"):
        return mode
    raise ValueError(f"TINYLOOP_KV_H_MODE={mode!r} is not supported; use 0 (kv), 1 (the "
                     "smallest: h4 with int4 KV, else h8), h8 or h4")


@contextlib.contextmanager
def _out_of_memory_as_runtime_error() -> Iterator[None]:
    """The seed's contract: allocation failure is RuntimeError('out of memory')."""
    try:
        yield
    except MemoryError:
        raise RuntimeError("out of memory") from None


class _Tally:
    """Sums a request's increments of two counts (a Callbacks.on_draft or on_depth) and writes
    them into the caller's stats mapping (None: nowhere) under `names`: the first count, the
    second, and their ratio second / first (0.0 while the first is 0)."""
    argument = ""                  # the generation argument the mapping comes from
    names: tuple[str, str, str] = ("", "", "")

    def __init__(self, out: MutableMapping[str, Any] | None) -> None:
        if out is not None and not isinstance(out, MutableMapping):
            raise ValueError(f"{self.argument} must be a dict or None, got {type(out).__name__}")
        self.out = out
        self.first = self.second = 0

    def __call__(self, first: int, second: int) -> None:
        self.first += first
        self.second += second

    def report(self) -> None:
        if self.out is not None:
            total, part, ratio = self.names
            self.out.update({total: self.first, part: self.second,
                             ratio: self.second / self.first if self.first else 0.0})


class _DraftTally(_Tally):
    """draft_stats: drafted, accepted, acceptance_rate (self-speculative decoding)."""
    argument, names = "draft_stats", ("drafted", "accepted", "acceptance_rate")


class _DepthTally(_Tally):
    """depth_stats: tokens (decode passes), loops (the core iterations they ran), mean_loops
    (adaptive depth, docs/spec.md §5.7)."""
    argument, names = "depth_stats", ("tokens", "loops", "mean_loops")


class PrefixCache:
    """A prompt prefix whose KV is computed once and shared by many generations.

    Opaque: exposes `prompt` (a read-only copy), `loops`, `cache_window`,
    `instruction_length`, `warm_start`,
    `storage` ("kv", "h8" or "h4": docs/api.md, "Hidden-state prefixes") and `nbytes`. Its tokens never change; a warm-start prefix may be deepened in place (`extend`).
    It keeps its model alive and is freed by the garbage collector; it has no close().
    """

    __slots__ = ("_model", "_state", "_lock", "__weakref__")

    def __init__(self, model: Model, state: EnginePrefix) -> None:
        self._model = model
        self._state = state
        self._lock = threading.Lock()         # one extension at a time

    @property
    def prompt(self) -> np.ndarray:
        view: np.ndarray = self._state.tokens.view()
        view.flags.writeable = False
        return view

    @property
    def loops(self) -> int:
        return self._state.loops

    @property
    def cache_window(self) -> int:
        return self._state.cache_window

    @property
    def instruction_length(self) -> int:
        """Its first tokens that form an instruction block (docs/spec.md §4.1); 0: causal."""
        return self._state.instruction

    @property
    def warm_start(self) -> bool:
        """Whether it was built with warm_start=True: it can then be deepened (`extend`)."""
        return self._state.warm_start

    @property
    def storage(self) -> str:
        """What it keeps at rest: its KV ("kv"), or each layer's input row ("h8", "h4")."""
        return self._state.storage

    @property
    def nbytes(self) -> int:
        return self._state.nbytes

    def __len__(self) -> int:
        return len(self._state.tokens)

    def __repr__(self) -> str:
        return (f"PrefixCache(tokens={len(self)}, loops={self.loops}, "
                f"cache_window={self.cache_window}, instruction_length={self.instruction_length}, "
                f"warm_start={self.warm_start}, "
                f"storage={self.storage!r}, nbytes={self.nbytes})")

    def extend(self, loops: int, prefill_chunk: int | None = None) -> None:
        """Deepen a warm-start prefix to depth `loops`, in place: only the iterations past its
        depth run, for every prefix token (in `prefill_chunk` chunks; default the model's),
        and the result is bit for bit a prefix built at `loops`. A depth <= its own is a no-op.
        Generations already running from it are unaffected; concurrent calls extend once.
        RuntimeError("loops mismatch: ...") for a prefix built without warm_start."""
        engine = self._model._live_engine()
        loops = P.check_loops(P.check_int("loops", loops, 1), self.loops)
        chunk = P.check_prefill_chunk(prefill_chunk, self._model._prefill_chunk)
        if loops <= self.loops:      # deep enough: no wait behind an extension in progress
            return
        with self._lock:
            if loops <= self.loops:
                return
            if not self.warm_start:
                raise RuntimeError(loops_mismatch(self.loops, loops))
            with _out_of_memory_as_runtime_error():
                engine.extend_prefix(self._state, loops, chunk)

    def to_bytes(self) -> bytes:
        """The prefix as bytes (docs/spec.md §7; docs/api.md, "Saving prefixes"), for
        Model.prefix_from_bytes in this or another process, on any backend of the same model
        file and kv_mode. Safe beside generations from it and its extension."""
        self._model._live_engine()
        return self._state.to_bytes()

    def __del__(self) -> None:
        # None only from here on, when no other method runs: _state is typed EnginePrefix
        state, self._state = getattr(self, "_state", None), None  # type: ignore[assignment]
        if state is not None:
            state.free()


class Model:
    """A looped language model loaded from a .tinyloop file.

    Model(path=None, *, backend="auto", threads=None, kv_mode=None, block_size=16,
          prefill_chunk=512, prefix_cache_bytes=256 MiB, device="auto", prefix_storage=None,
          prefix_cache_dir=None, prefix_cache_disk_bytes=0).
    `path=None` loads the
    bundled demo model; `kv_mode` "int8" or "int4" is how the KV cache stores keys and values
    (None: "int4" when TINYLOOP_KV_INT4 is set, else "int8"; `self.kv_mode` the one chosen);
    `prefix_storage` what build_prefix_cache keeps by default, "kv", "h8" or "h4" (None: from
    TINYLOOP_KV_H_MODE, docs/api.md "Hidden-state prefixes"; `self.prefix_storage`);
    `prefix_cache_bytes=0` switches the automatic prefix cache off;
    `prefix_cache_dir` backs it with block files in that directory (created if missing, one
    level), kept under `prefix_cache_disk_bytes` (0: no limit): evicted blocks, and at close
    every cached one, are written there and read back by later requests and processes
    (docs/api.md "Disk tier"; needs prefix_cache_bytes > 0);
    `device="cuda"` runs the native backend's forward pass on an NVIDIA GPU ("auto" and "cpu":
    the CPU). `backend` and `device` say what it runs on, `runtime()` how.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, backend: str = "auto",
                 threads: int | None = None, kv_mode: str | None = None, block_size: int = 16,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
                 device: str = "auto", prefix_storage: str | None = None,
                 prefix_cache_dir: str | os.PathLike[str] | None = None,
                 prefix_cache_disk_bytes: int = 0) -> None:
        self.kv_mode = _check_kv_mode(kv_mode)
        self.prefix_storage = _check_prefix_storage(prefix_storage, self.kv_mode)
        self._block_size = P.check_int("block_size", block_size, 1, P.MAX_BLOCK_SIZE)
        self._prefill_chunk = P.check_int("prefill_chunk", prefill_chunk, 1)
        cache_bytes = P.check_int("prefix_cache_bytes", prefix_cache_bytes, 0)
        disk_bytes = P.check_int("prefix_cache_disk_bytes", prefix_cache_disk_bytes, 0)
        if prefix_cache_dir is not None:
            if not isinstance(prefix_cache_dir, (str, bytes, os.PathLike)):
                raise ValueError("prefix_cache_dir must be a path (str, bytes or os.PathLike), "
                                 f"got {type(prefix_cache_dir).__name__}")
            prefix_cache_dir = os.fsdecode(prefix_cache_dir)
            if not cache_bytes:
                raise ValueError("prefix_cache_dir needs prefix_cache_bytes > 0")
        if threads is not None:
            P.check_int("threads", threads, 1, P.MAX_THREADS)
        path = demo_model_path() if path is None else os.fspath(path)
        self.path = path
        with _out_of_memory_as_runtime_error():
            self._engine: Engine[Any] | None = open_engine(
                backend, path, block_size=self._block_size, threads=threads,
                prefix_cache_bytes=cache_bytes, device=device, kv_mode=self.kv_mode,
                prefix_cache_dir=prefix_cache_dir, prefix_cache_disk_bytes=disk_bytes)
        runtime = self._engine.runtime()
        self.backend, self.device = runtime["backend"], runtime["device"]
        self._config = self._engine.config
        if (prefix_storage is None and os.environ.get("TINYLOOP_KV_H_MODE") == "1"
                and self.prefix_storage == "h8" and self._config.act_block):
            self.prefix_storage = "kv"  # the smallest exact storage: h8 cannot hold block inputs
        self._lock = threading.Lock()
        # the file's meta.* texts (tokenizer, chat template), read now, next to the engine's
        # one read of the file, so a file replaced later cannot change the model's tokenizer
        self._meta = read_meta(path)
        self._tokenizer: Tokenizer | None = None

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release the model. Idempotent; later calls raise RuntimeError('model was closed')."""
        with self._lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    @property
    def closed(self) -> bool:
        return self._engine is None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _live_engine(self) -> Engine[Any]:
        engine = self._engine
        if engine is None:
            raise RuntimeError("model was closed")
        return engine

    # -- introspection ----------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The model's configuration as a dict (includes `default_loops`)."""
        self._live_engine()
        return self._config.to_dict()

    def stop_token_ids(self) -> frozenset[int]:
        """The ids whose emission ends every generation: eos_id (when >= 0) and stop_ids."""
        self._live_engine()
        return self._config.stop_token_ids()

    def runtime(self) -> dict[str, Any]:
        """How the model runs here (docs/api.md): backend, device, device_name, isa (the
        kernel path), threads, kv_block_size, weight_bytes, device_weight_bytes, kv_mode."""
        return self._live_engine().runtime()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.backend
        return f"Model({self.path!r}, {state}, {self._config.name or 'unnamed'})"

    # -- text (models with a tokenizer: "bytes" or "hf") ------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        """The model's Tokenizer (tinyloop/tokenizer.py), opened on first use; ValueError for a
        model without one (tokenizer "none"), ImportError when an "hf" tokenizer's optional
        packages are missing; RuntimeError once the model is closed."""
        self._live_engine()
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = open_tokenizer(self._config, self._meta)
            return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Byte tokenizer: its UTF-8 bytes. "hf": tokenizer.json's
        pipeline, BOS/EOS as its config says (docs/api.md); add_special_tokens=False adds none."""
        return self.tokenizer.encode(text, add_special_tokens)

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids; never raises on partial or invalid UTF-8 (uses U+FFFD)."""
        return self.tokenizer.decode(tokens, skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **variables: Any) -> str | list[int]:
        """`messages` ([{"role": ..., "content": ...}, ...]) rendered with the model's chat
        template, as transformers renders it; with add_generation_prompt the text ends where
        the assistant's reply starts. tokenize=True returns its token ids instead (encoded
        without added special tokens: the template writes them). `variables` reach the template."""
        template = self.tokenizer.chat_template
        if template is None:
            kind = self._config.tokenizer
            where = ("its meta.tokenizer_config has no chat_template" if kind == "hf"
                     else f"tokenizer={kind!r}")
            raise ValueError(f"model {self._config.name or self.path!r} has no chat template "
                             f"({where})")
        text = template.render(messages, add_generation_prompt, **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -- generation -------------------------------------------------------------------------
    def _params(self, max_tokens: int = 32, loops: int | None = None, temperature: float = 0.0,
                top_k: int = 50, top_p: float = 1.0, cache_window: int = 0,
                repetition_penalty: float = 1.0, stop_sequences: Sequence[TokenIds] | None = (),
                seed: int | None = None, prefill_chunk: int | None = None,
                cache_salt: str | None = None, draft_loops: int | str | None = None,
                n_draft: int | None = None, draft_wave: bool = False, exit_rule: str | None = None,
                exit_threshold: float | None = None, min_loops: int | None = None,
                instruction_length: int | None = None) -> GenerationParams:
        return P.generation_params(
            self._config, max_tokens=max_tokens, loops=loops, temperature=temperature,
            top_k=top_k, top_p=top_p, cache_window=cache_window,
            repetition_penalty=repetition_penalty, stop_sequences=stop_sequences, seed=seed,
            prefill_chunk=prefill_chunk, default_chunk=self._prefill_chunk, cache_salt=cache_salt,
            draft_loops=draft_loops, n_draft=n_draft, draft_wave=draft_wave, exit_rule=exit_rule,
            exit_threshold=exit_threshold, min_loops=min_loops,
            instruction_length=instruction_length)

    def _request(self, prompt: TokenIds | None, prefix: PrefixCache | None,
                 kwargs: Mapping[str, Any]) -> CheckedRequest:
        """Check one request: (all tokens, the tokens to run, GenerationParams). With a
        prefix, `prompt` is the suffix (None or empty allowed), loops/cache_window default
        to the prefix's, and a depth past the prefix's needs a warm-start prefix (the caller
        extends it once every request is checked)."""
        if prefix is None:
            tokens = P.check_tokens("prompt", prompt, self._config.vocab_size)
            params = self._params(**kwargs)
            P.check_instruction(params.instruction_length, len(tokens))
            P.check_length(len(tokens) + params.max_tokens, self._config.max_seq_len)
            return tokens, tokens, params
        if not isinstance(prefix, PrefixCache):
            raise ValueError(f"prefix must be a PrefixCache, got {type(prefix).__name__}")
        if prefix._model is not self:
            raise ValueError("prefix was built by another model")
        kwargs = dict(kwargs)
        if kwargs.get("loops") is None:
            kwargs["loops"] = prefix.loops
        if kwargs.get("cache_window") is None:
            kwargs["cache_window"] = prefix.cache_window
        params = self._params(**kwargs)
        if params.instruction_length:
            raise ValueError(f"instruction_length: a generation from a PrefixCache takes the "
                             f"prefix's ({prefix.instruction_length}), got "
                             f"{params.instruction_length}")
        if params.loops > prefix.loops and not prefix.warm_start:
            raise RuntimeError(loops_mismatch(prefix.loops, params.loops))
        if params.cache_window != prefix.cache_window:
            raise RuntimeError(f"cache_window mismatch: prefix built with "
                               f"cache_window={prefix.cache_window}, requested {params.cache_window}")
        rest = (np.zeros(0, np.int32) if prompt is None or len(prompt) == 0
                else P.check_tokens("suffix", prompt, self._config.vocab_size))
        tokens = np.concatenate([prefix._state.tokens, rest])
        P.check_length(len(tokens) + params.max_tokens, self._config.max_seq_len)
        return tokens, rest, params

    # generate, generate_from_prefix_cache and generate_batch: the type of a result follows
    # return_logits, ids (list[int]) or (ids, logits) (IdsAndLogits).
    @overload
    def generate(self, prompt: TokenIds, max_tokens: int = ..., loops: int | None = ...,
                 temperature: float = ..., top_k: int = ..., top_p: float = ...,
                 cache_window: int = ..., repetition_penalty: float = ...,
                 stop_sequences: Sequence[TokenIds] | None = ..., seed: int | None = ...,
                 prefill_chunk: int | None = ..., return_logits: Literal[False] = ...,
                 on_token: Callable[[int], None] | None = ..., cache_salt: str | None = ...,
                 on_prefill: Callable[[int, int], None] | None = ...,
                 draft_loops: int | str | None = ..., n_draft: int | None = ..., draft_wave: bool = ...,
                 draft_stats: MutableMapping[str, Any] | None = ...,
                 exit_rule: str | None = ..., exit_threshold: float | None = ...,
                 min_loops: int | None = ..., depth_stats: MutableMapping[str, Any] | None = ...,
                 instruction_length: int = ...) -> list[int]: ...

    @overload
    def generate(self, prompt: TokenIds, max_tokens: int = ..., loops: int | None = ...,
                 temperature: float = ..., top_k: int = ..., top_p: float = ...,
                 cache_window: int = ..., repetition_penalty: float = ...,
                 stop_sequences: Sequence[TokenIds] | None = ..., seed: int | None = ...,
                 prefill_chunk: int | None = ..., *, return_logits: Literal[True],
                 on_token: Callable[[int], None] | None = ..., cache_salt: str | None = ...,
                 on_prefill: Callable[[int, int], None] | None = ...,
                 draft_loops: int | str | None = ..., n_draft: int | None = ..., draft_wave: bool = ...,
                 draft_stats: MutableMapping[str, Any] | None = ...,
                 exit_rule: str | None = ..., exit_threshold: float | None = ...,
                 min_loops: int | None = ..., depth_stats: MutableMapping[str, Any] | None = ...,
                 instruction_length: int = ...) -> IdsAndLogits: ...

    @overload
    def generate(self, prompt: TokenIds, max_tokens: int = ..., loops: int | None = ...,
                 temperature: float = ..., top_k: int = ..., top_p: float = ...,
                 cache_window: int = ..., repetition_penalty: float = ...,
                 stop_sequences: Sequence[TokenIds] | None = ..., seed: int | None = ...,
                 prefill_chunk: int | None = ..., return_logits: bool = ...,
                 on_token: Callable[[int], None] | None = ..., cache_salt: str | None = ...,
                 on_prefill: Callable[[int, int], None] | None = ...,
                 draft_loops: int | str | None = ..., n_draft: int | None = ..., draft_wave: bool = ...,
                 draft_stats: MutableMapping[str, Any] | None = ...,
                 exit_rule: str | None = ..., exit_threshold: float | None = ...,
                 min_loops: int | None = ..., depth_stats: MutableMapping[str, Any] | None = ...,
                 instruction_length: int = ...) -> list[int] | IdsAndLogits: ...

    def generate(self, prompt: TokenIds, max_tokens: int = 32, loops: int | None = None,
                 temperature: float = 0.0, top_k: int = 50, top_p: float = 1.0,
                 cache_window: int = 0, repetition_penalty: float = 1.0,
                 stop_sequences: Sequence[TokenIds] | None = (), seed: int | None = None,
                 prefill_chunk: int | None = None, return_logits: bool = False,
                 on_token: Callable[[int], None] | None = None, cache_salt: str | None = None,
                 on_prefill: Callable[[int, int], None] | None = None,
                 draft_loops: int | str | None = None, n_draft: int | None = None, draft_wave: bool = False,
                 draft_stats: MutableMapping[str, Any] | None = None,
                 exit_rule: str | None = None, exit_threshold: float | None = None,
                 min_loops: int | None = None, depth_stats: MutableMapping[str, Any] | None = None,
                 instruction_length: int = 0) -> list[int] | IdsAndLogits:
        """Run `prompt` and sample up to `max_tokens` tokens. Returns prompt + emitted ids.

        on_token(id), if given, is called with each emitted id as soon as it is sampled
        (streaming); on_prefill(done, total) after each prompt chunk (progress; `done` counts
        reused positions too). An exception either raises stops generation and propagates.

        With return_logits=True returns (tokens, logits) where logits is a float32 array
        (n_emitted, vocab_size): the logits each emitted token was sampled from.

        The automatic prefix cache reuses the longest cached block-aligned prefix of the
        prompt; only requests with the same `cache_salt` share blocks. Results never change.

        Self-speculative decoding: with `draft_loops` (1 .. loops-1) each round drafts
        `n_draft` tokens (default 4) at that depth and verifies them at `loops` in one pass;
        the tokens and logits are exactly plain decoding's. `draft_stats` (a dict) receives
        drafted, accepted and acceptance_rate. With `draft_wave=True` the drafts and their
        verification run as a wave instead (docs/spec.md §5.6.1: one pass per step, each
        position in flight running its next loop on the same weights, at most `n_draft`
        drafts in flight) where the backend has a wave pass (native CPU), else in rounds:
        the same tokens, fewer weight reads. There `n_draft` defaults to `loops` (every
        draft the pipeline can hold) and `draft_loops="auto"` lets the wave choose the draft
        depth from the acceptance it measures.

        Adaptive depth (docs/spec.md §5.7): with `exit_rule` ("gate": the model's exit gate,
        "latent": the state's relative change) each decoded token stops after the first core
        iteration, at least `min_loops` (default 1), where the rule's criterion reaches
        `exit_threshold` (default: the model's for "gate", 0.03 for "latent"); prompt tokens
        run all `loops`. A token exits at the same iteration on every backend, alone or
        batched. `depth_stats` (a dict) receives tokens, loops and mean_loops of the decode
        passes.

        Prefix-LM (docs/spec.md §4.1): the first `instruction_length` prompt tokens (at most
        the prompt's length) attend to each other bidirectionally, as HRM-Text's
        `token_type_ids` 1 mark them; every later position is causal. 0: a causal prompt.
        """
        engine = self._live_engine()
        tally, depths = _DraftTally(draft_stats), _DepthTally(depth_stats)
        tokens, _, params = self._request(prompt, None, dict(
            max_tokens=max_tokens, loops=loops, temperature=temperature, top_k=top_k,
            top_p=top_p, cache_window=cache_window, repetition_penalty=repetition_penalty,
            stop_sequences=stop_sequences, seed=seed, prefill_chunk=prefill_chunk,
            cache_salt=cache_salt, draft_loops=draft_loops, n_draft=n_draft,
            draft_wave=draft_wave, exit_rule=exit_rule, exit_threshold=exit_threshold,
            min_loops=min_loops, instruction_length=instruction_length))
        try:
            with _out_of_memory_as_runtime_error():
                emitted, logits = engine.generate(tokens, params, return_logits, Callbacks(
                    on_token=on_token, on_prefill=on_prefill, on_draft=tally, on_depth=depths))
        finally:
            tally.report()
            depths.report()
        return self._result(tokens, emitted, logits, return_logits)

    def build_prefix_cache(self, prompt: TokenIds, loops: int | None = None, cache_window: int = 0,
                           prefill_chunk: int | None = None,
                           warm_start: bool = False, storage: str | None = None,
                           instruction_length: int = 0) -> PrefixCache:
        """Prefill `prompt` once at depth `loops`; the result serves any depth <= loops.
        warm_start=True also keeps every token's state after the last iteration (4 * d_model
        bytes a token, twice that with injection), so that a deeper request extends the
        prefix in place instead of failing (PrefixCache.extend). `storage` (None: the
        model's prefix_storage) "h8" or "h4" keeps each layer's input row instead of the KV,
        rebuilding the KV for every generation from it (docs/api.md, "Hidden-state
        prefixes"); ValueError naming the reason where it cannot (with warm_start, or where
        the rows take as many bytes as the KV). `instruction_length`: as in generate; every
        generation from the prefix has it (its suffix is causal)."""
        engine = self._live_engine()
        args = self._prompt_run(prompt, loops, cache_window, prefill_chunk, instruction_length)
        if not isinstance(warm_start, (bool, np.bool_)):
            raise ValueError(f"warm_start must be a bool, got {type(warm_start).__name__}")
        storage = check_prefix_storage(self.prefix_storage if storage is None else storage,
                                       warm_start=bool(warm_start))
        tokens, depth, window, chunk, instruction = args
        with _out_of_memory_as_runtime_error():
            return PrefixCache(self, engine.build_prefix(tokens, depth, window, chunk,
                                                         warm_start=bool(warm_start),
                                                         storage=storage, instruction=instruction))

    def prefix_from_bytes(self, blob: bytes | bytearray | memoryview) -> PrefixCache:
        """The PrefixCache whose to_bytes() gave `blob`, saved by a model of the same file and
        kv_mode on any backend: every generation from it is the original's, bit for bit.
        PrefixFormatError (a ValueError) naming the field for a corrupted blob or one saved
        from another model or kv_mode."""
        engine = self._live_engine()
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise ValueError("blob must be bytes, bytearray or memoryview, got "
                             f"{type(blob).__name__}")
        if isinstance(blob, memoryview) and not blob.c_contiguous:
            raise ValueError("blob: a memoryview must be C-contiguous (its bytes in order)")
        with _out_of_memory_as_runtime_error():
            return PrefixCache(self, engine.prefix_from_bytes(blob))

    @overload
    def generate_from_prefix_cache(self, prefix: PrefixCache, max_tokens: int = ...,
                                   loops: int | None = ..., temperature: float = ...,
                                   top_k: int = ..., top_p: float = ...,
                                   cache_window: int | None = ...,
                                   repetition_penalty: float = ...,
                                   stop_sequences: Sequence[TokenIds] | None = ...,
                                   seed: int | None = ..., suffix: TokenIds | None = ...,
                                   prefill_chunk: int | None = ...,
                                   return_logits: Literal[False] = ...,
                                   on_token: Callable[[int], None] | None = ...,
                                   on_prefill: Callable[[int, int], None] | None = ...,
                                   draft_loops: int | str | None = ..., n_draft: int | None = ..., draft_wave: bool = ...,
                                   draft_stats: MutableMapping[str, Any] | None = ...,
                 exit_rule: str | None = ..., exit_threshold: float | None = ...,
                 min_loops: int | None = ..., depth_stats: MutableMapping[str, Any] | None = ...
                                   ) -> list[int]: ...

    @overload
    def generate_from_prefix_cache(self, prefix: PrefixCache, max_tokens: int = ...,
                                   loops: int | None = ..., temperature: float = ...,
                                   top_k: int = ..., top_p: float = ...,
                                   cache_window: int | None = ...,
                                   repetition_penalty: float = ...,
                                   stop_sequences: Sequence[TokenIds] | None = ...,
                                   seed: int | None = ..., suffix: TokenIds | None = ...,
                                   prefill_chunk: int | None = ...,
                                   *, return_logits: Literal[True],
                                   on_token: Callable[[int], None] | None = ...,
                                   on_prefill: Callable[[int, int], None] | None = ...,
                                   draft_loops: int | str | None = ..., n_draft: int | None = ..., draft_wave: bool = ...,
                                   draft_stats: MutableMapping[str, Any] | None = ...,
                 exit_rule: str | None = ..., exit_threshold: float | None = ...,
                 min_loops: int | None = ..., depth_stats: MutableMapping[str, Any] | None = ...
                                   ) -> IdsAndLogits: ...

    @overload
    def generate_from_prefix_cache(self, prefix: PrefixCache, max_tokens: int = ...,
                                   loops: int | None = ..., temperature: float = ...,
                                   top_k: int = ..., top_p: float = ...,
                                   cache_window: int | None = ...,
                                   repetition_penalty: float = ...,
                                   stop_sequences: Sequence[TokenIds] | None = ...,
                                   seed: int | None = ..., suffix: TokenIds | None = ...,
                                   prefill_chunk: int | None = ...,
                                   return_logits: bool = ...,
                                   on_token: Callable[[int], None] | None = ...,
                                   on_prefill: Callable[[int, int], None] | None = ...,
                                   draft_loops: int | str | None = ..., n_draft: int | None = ..., draft_wave: bool = ...,
                                   draft_stats: MutableMapping[str, Any] | None = ...,
                 exit_rule: str | None = ..., exit_threshold: float | None = ...,
                 min_loops: int | None = ..., depth_stats: MutableMapping[str, Any] | None = ...
                                   ) -> list[int] | IdsAndLogits: ...

    def generate_from_prefix_cache(self, prefix: PrefixCache, max_tokens: int = 32,
                                   loops: int | None = None, temperature: float = 0.0,
                                   top_k: int = 50, top_p: float = 1.0,
                                   cache_window: int | None = None,
                                   repetition_penalty: float = 1.0,
                                   stop_sequences: Sequence[TokenIds] | None = (),
                                   seed: int | None = None, suffix: TokenIds | None = None,
                                   prefill_chunk: int | None = None, return_logits: bool = False,
                                   on_token: Callable[[int], None] | None = None,
                                   on_prefill: Callable[[int, int], None] | None = None,
                                   draft_loops: int | str | None = None, n_draft: int | None = None, draft_wave: bool = False,
                                   draft_stats: MutableMapping[str, Any] | None = None,
                 exit_rule: str | None = None, exit_threshold: float | None = None,
                 min_loops: int | None = None, depth_stats: MutableMapping[str, Any] | None = None
                                   ) -> list[int] | IdsAndLogits:
        """Decode from a PrefixCache. `loops=None` and `cache_window=None` mean the prefix's.

        `suffix` (optional token ids) is fed after the prefix before decoding: the usual shared
        system prompt + per-request text. Returns prefix + suffix + emitted ids, exactly what
        generate(prefix.prompt + suffix, ...) returns. The prefix's tokens never change; a
        `loops` past a warm-start prefix's depth first extends it in place (once: later calls
        find it deep enough). draft_loops, n_draft, draft_stats, exit_rule, exit_threshold,
        min_loops, depth_stats: as in generate.
        """
        engine = self._live_engine()
        tally, depths = _DraftTally(draft_stats), _DepthTally(depth_stats)
        tokens, rest, params = self._request(suffix, prefix, dict(
            max_tokens=max_tokens, loops=loops, temperature=temperature, top_k=top_k,
            top_p=top_p, cache_window=cache_window, repetition_penalty=repetition_penalty,
            stop_sequences=stop_sequences, seed=seed, prefill_chunk=prefill_chunk,
            draft_loops=draft_loops, n_draft=n_draft, draft_wave=draft_wave, exit_rule=exit_rule,
            exit_threshold=exit_threshold, min_loops=min_loops))
        try:
            prefix.extend(params.loops, params.prefill_chunk)
            with _out_of_memory_as_runtime_error():
                emitted, logits = engine.generate_from_prefix(
                    prefix._state, rest, params, return_logits,
                    Callbacks(on_token=on_token, on_prefill=on_prefill, on_draft=tally,
                              on_depth=depths))
        finally:
            tally.report()
            depths.report()
        return self._result(tokens, emitted, logits, return_logits)

    @overload
    def generate_batch(self, prompts: Sequence[TokenIds], *, prefix: PrefixCache | None = ...,
                       per_request: Sequence[Mapping[str, Any]] | None = ...,
                       return_logits: Literal[False] = ..., **params: Any
                       ) -> list[list[int]]: ...

    @overload
    def generate_batch(self, prompts: Sequence[TokenIds], *, prefix: PrefixCache | None = ...,
                       per_request: Sequence[Mapping[str, Any]] | None = ...,
                       return_logits: Literal[True], **params: Any
                       ) -> list[IdsAndLogits]: ...

    @overload
    def generate_batch(self, prompts: Sequence[TokenIds], *, prefix: PrefixCache | None = ...,
                       per_request: Sequence[Mapping[str, Any]] | None = ...,
                       return_logits: bool = ..., **params: Any
                       ) -> list[list[int] | IdsAndLogits]: ...

    def generate_batch(self, prompts: Sequence[TokenIds], *, prefix: PrefixCache | None = None,
                       per_request: Sequence[Mapping[str, Any]] | None = None,
                       return_logits: bool = False, **params: Any
                       ) -> Sequence[list[int] | IdsAndLogits]:
        """Generate for many requests at once; returns one result per prompt, each exactly
        what generate (or, with `prefix`, generate_from_prefix_cache with that suffix) returns.

        prompts: a list of token sequences; with `prefix` (a PrefixCache) they are the
        suffixes after it and may be empty, e.g. `[[]] * 8` for 8 continuations. `params` are
        generate's keyword arguments, shared by every request; `per_request`, if given, is a
        list (one per prompt) of dicts overriding them for that request, e.g. its own seed.
        An engine may decode all live sequences together in one batched step per token
        (libtinyloop does); the results are the same either way. A `draft_stats` dict shared
        by several requests receives their sums. A depth past a warm-start prefix's extends
        it once, to the deepest request's, after every request is checked.
        """
        engine = self._live_engine()
        prompts = list(prompts)
        overrides = [{}] * len(prompts) if per_request is None else list(per_request)
        if len(overrides) != len(prompts):
            raise ValueError(f"per_request has {len(overrides)} entries for {len(prompts)} prompts")
        checked: list[tuple[np.ndarray, np.ndarray, GenerationParams, Callbacks]] = []
        tallies: dict[tuple[str, int], _Tally] = {}  # one per stats mapping

        def tally_of(kind: type[_Tally], stats: Any) -> _Tally | None:
            if stats is None:
                return None
            return tallies.setdefault((kind.argument, id(stats)), kind(stats))

        for i, (prompt, extra) in enumerate(zip(prompts, overrides)):
            kwargs = {**params, **extra}
            unknown = sorted(set(kwargs) - set(REQUEST_ARGUMENTS))
            if unknown:
                raise ValueError(f"request {i}: unknown generation argument(s) {unknown}")
            drafts, depths = kwargs.pop("draft_stats", None), kwargs.pop("depth_stats", None)
            try:
                callbacks = Callbacks(on_draft=tally_of(_DraftTally, drafts),
                                      on_depth=tally_of(_DepthTally, depths))
                checked.append(self._request(prompt, prefix, kwargs) + (callbacks,))
            except (ValueError, RuntimeError) as exc:
                raise type(exc)(f"request {i}: {exc}") from None
        if prefix is not None and checked:     # a warm-start prefix deepens once, for them all
            prefix.extend(max(request[2].loops for request in checked))
        state = None if prefix is None else prefix._state
        try:
            with _out_of_memory_as_runtime_error():
                results = engine.generate_batch(
                    [(state, rest, params, callbacks) for _, rest, params, callbacks in checked],
                    return_logits)
        finally:
            for tally in tallies.values():
                tally.report()
        return [self._result(tokens, emitted, logits, return_logits)
                for (tokens, *_), (emitted, logits) in zip(checked, results)]

    # -- the automatic prefix cache ---------------------------------------------------------
    def cache_stats(self) -> dict[str, int]:
        """Counters of the automatic prefix cache (docs/api.md): lookups, hit_tokens,
        prefilled_tokens, inserted_blocks, evicted_blocks, blocks, bytes_in_use, budget_bytes."""
        return self._live_engine().cache_stats()

    def clear_prefix_cache(self) -> None:
        """Drop every cached block (blocks in use by running requests live on in them)."""
        self._live_engine().clear_prefix_cache()

    def logits(self, prompt: TokenIds, loops: int | None = None, cache_window: int = 0,
               prefill_chunk: int | None = None, instruction_length: int = 0) -> np.ndarray:
        """Logits at every position of `prompt`: float32 array (len(prompt), vocab_size);
        `instruction_length` as in generate."""
        engine = self._live_engine()
        args = self._prompt_run(prompt, loops, cache_window, prefill_chunk, instruction_length)
        with _out_of_memory_as_runtime_error():
            return engine.logits(*args)

    def _prompt_run(self, prompt: TokenIds, loops: int | None, cache_window: int,
                    prefill_chunk: int | None, instruction_length: int
                    ) -> tuple[np.ndarray, int, int, int, int]:
        """Checked (tokens, loops, window, chunk, instruction length) for running a prompt
        without decoding."""
        tokens = P.check_tokens("prompt", prompt, self._config.vocab_size)
        loops = P.check_loops(loops, self._config.default_loops)
        window = P.check_int("cache_window", cache_window, 0)
        chunk = P.check_prefill_chunk(prefill_chunk, self._prefill_chunk)
        instruction = P.check_int("instruction_length", instruction_length, 0)
        P.check_instruction(instruction, len(tokens))
        P.check_length(len(tokens), self._config.max_seq_len)
        return tokens, loops, window, chunk, instruction

    @staticmethod
    def _result(tokens: np.ndarray, emitted: Sequence[int], logits: Sequence[np.ndarray] | None,
                return_logits: bool) -> list[int] | IdsAndLogits:
        out: list[int] = tokens.tolist() + list(emitted)
        if return_logits:
            assert logits is not None     # an engine asked for logits returns them
            return out, np.stack(logits).astype(np.float32, copy=False)
        return out
