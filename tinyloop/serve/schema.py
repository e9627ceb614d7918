"""OpenAI request bodies in, checked generation requests out; OpenAI error bodies.

`completion_request` and `chat_request` read the JSON body of POST /v1/completions and
/v1/chat/completions (the OpenAI API's schema plus TinyLoop's top_k, repetition_penalty,
loops, cache_salt, draft_loops / n_draft for self-speculative decoding, exit_rule /
exit_threshold / min_loops for adaptive depth, and instruction_length for prefix-LM models:
an integer or "prompt", the whole prompt) and return a
`GenerationRequest`: prompt token ids and the keyword arguments of `Scheduler.add`, every value
checked. Anything wrong raises `RequestError` naming the field, which the app answers with the
OpenAI error body (`RequestError.body`). Nothing here runs the model: it only tokenizes and
renders chat templates.

Defaults follow the OpenAI API: temperature 1, top_p 1, no top-k (top_k 0; Model.generate's
default of 50 is not OpenAI's), max_tokens 16 for a completion and the rest of the context
for a chat reply, a fresh random seed when none is given.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from .. import params as P
from ..tokenizer import end_of_turn_stops

if TYPE_CHECKING:
    from ..model import Model

Body = Mapping[str, Any]           # a request's parsed JSON object

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
COMPLETION_MAX_TOKENS = 16         # the OpenAI default of /v1/completions
# Fields of the OpenAI API that TinyLoop does not implement: accepted only with the value that
# means "off" (what a client sends by default), refused otherwise so nothing is silently ignored.
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "logprobs": False,
           "top_logprobs": None, "echo": False, "best_of": 1, "suffix": None, "tools": None,
           "tool_choice": None, "parallel_tool_calls": None, "response_format": None,
           "service_tier": None, "store": None, "metadata": None, "modalities": None,
           "reasoning_effort": None}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "loops",
          "draft_loops", "n_draft", "exit_rule", "exit_threshold", "min_loops", "cache_salt",
          "instruction_length", "seed", "stop", "stream", "stream_options", "n", "user"}
COMPLETION_FIELDS = COMMON | {"prompt"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens"}


class RequestError(Exception):
    """A request the server cannot answer: HTTP `status` (400 by default) with the OpenAI
    error body of type `kind` naming the field `param`, and the response `headers` (e.g.
    Retry-After)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 kind: str = "invalid_request_error", code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code
        self.headers = headers or {}

    @property
    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A checked request: what the engine runs and how the reply is shaped."""

    prompt_field: str            # "prompt" or "messages": the field errors about the prompt name
    prompt_ids: list[int]
    sampling: dict[str, Any]     # Scheduler.add's keyword arguments (seed always set)
    stop: tuple[str, ...]        # text stop sequences, checked on the decoded reply
    stream: bool
    include_usage: bool          # stream_options.include_usage: a last chunk with the usage


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:           # also invalid UTF-8
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def check_model(body: Body, model_id: str) -> None:
    """`model` is required and must name the served model (404 model_not_found otherwise)."""
    name = _field(body, "model", str, required=True)
    if name != model_id:
        raise RequestError(f"the model {name!r} does not exist; this server serves {model_id!r}",
                           "model", 404, code="model_not_found")


def completion_request(body: Body, model: Model) -> GenerationRequest:
    """POST /v1/completions: `prompt` is a string, token ids, or a list of one of them."""
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise RequestError(f"prompt: a batch of {len(prompt)} prompts is not supported; "
                               "send one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = _encode(model, prompt, "prompt")
    elif isinstance(prompt, list):
        ids = _token_ids(model, prompt)
    else:
        raise RequestError("prompt must be a string or a list of token ids, got "
                           f"{_kind(prompt)}", "prompt")
    return _request(body, model, "prompt", ids, "max_tokens", COMPLETION_MAX_TOKENS, ())


def chat_request(body: Body, model: Model) -> GenerationRequest:
    """POST /v1/chat/completions: `messages` rendered with the model's chat template; the
    model's end-of-turn tokens (end_of_turn_stops: the tokenizer's end of turn and eos, where
    they are not stop ids) stop too; where such a token is text (a bytes model's end-of-turn
    byte), its text is a stop as well, so the reply's content ends before it, as a special
    token's would."""
    _check_fields(body, CHAT_FIELDS)
    messages = _messages(body.get("messages"))
    try:
        ids = [int(i) for i in model.apply_chat_template(messages, add_generation_prompt=True,
                                                         tokenize=True)]
    except ValueError as exc:
        raise RequestError(f"messages: {exc}", "messages") from None
    end_of_turn = end_of_turn_stops(model.tokenizer, model.stop_token_ids())
    stops = [(token,) for token in end_of_turn]
    field = ("max_completion_tokens" if body.get("max_completion_tokens") is not None
             else "max_tokens")
    request = _request(body, model, "messages", ids, field, None, stops)
    texts = [model.decode([token], skip_special_tokens=True) for token in end_of_turn]
    return dataclasses.replace(request, stop=request.stop + tuple(text for text in texts if text))


def _request(body: Body, model: Model, prompt_field: str, ids: list[int], max_field: str,
             default_max: Optional[int], token_stops: Sequence[tuple[int, ...]]
             ) -> GenerationRequest:
    if not ids:
        raise RequestError(f"{prompt_field} is empty: it encodes to no tokens", prompt_field)
    cfg = model.config()
    room = cfg["max_seq_len"] - len(ids)
    if room < 1:
        raise RequestError(f"{prompt_field} is {len(ids)} tokens; the model's max_seq_len "
                           f"{cfg['max_seq_len']} leaves no room for a reply", prompt_field)
    max_tokens = _number(body, max_field, int, lambda v: P.check_int(max_field, v, 1),
                         room if default_max is None else default_max)
    if max_tokens > room:
        raise RequestError(f"{max_field} {max_tokens} plus the {len(ids)} tokens of "
                           f"{prompt_field} exceeds the model's max_seq_len {cfg['max_seq_len']}",
                           max_field)
    n = _number(body, "n", int, lambda v: P.check_int("n", v, 1), 1)
    if n != 1:
        raise RequestError(f"n must be 1 (one choice per request), got {n}", "n")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(f"stream_options must be an object, got {_kind(options)}",
                           "stream_options")
    include_usage = _field(options or {}, "include_usage", bool, "stream_options.include_usage")
    stream = bool(_field(body, "stream", bool))
    if options is not None and not stream:
        raise RequestError("stream_options is only allowed with stream: true", "stream_options")
    _field(body, "user", str)
    loops = _number(body, "loops", int, lambda v: P.check_loops(v, cfg["default_loops"]), None)
    draft_loops, n_draft = _draft(body, cfg["default_loops"] if loops is None else loops)
    exit_rule, exit_threshold, min_loops = _exit(body, cfg, loops, n_draft)
    sampling = dict(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", float,
                            lambda v: P.check_real("temperature", v, 0.0, True), 1.0),
        top_p=_number(body, "top_p", float,
                      lambda v: P.check_real("top_p", v, 0.0, False, 1.0), 1.0),
        top_k=_number(body, "top_k", int, lambda v: P.check_int("top_k", v, 0), 0),
        repetition_penalty=_number(
            body, "repetition_penalty", float,
            lambda v: P.check_real("repetition_penalty", v, 0.0, False), 1.0),
        loops=loops,
        draft_loops=draft_loops,
        n_draft=n_draft,
        exit_rule=exit_rule,
        exit_threshold=exit_threshold,
        min_loops=min_loops,
        seed=P.check_seed(_number(body, "seed", int, P.check_seed, None)),   # None: a fresh one
        cache_salt=_field(body, "cache_salt", str) or "",
        stop_sequences=token_stops,
        instruction_length=_instruction(body, len(ids)),
    )
    if "\0" in sampling["cache_salt"]:
        raise RequestError("cache_salt must not contain NUL characters", "cache_salt")
    return GenerationRequest(prompt_field, ids, sampling, _stops(body.get("stop")), stream,
                             bool(include_usage))


def _draft(body: Body, loops: int) -> tuple[int, int]:
    """(draft_loops, n_draft) of a request at depth `loops`, by tinyloop.params' rules (0, 0
    when absent); an error names the field its message is about."""
    draft_loops = _number(body, "draft_loops", int, lambda v: v, None)
    n_draft = _number(body, "n_draft", int, lambda v: v, None)
    try:
        return P.check_draft(draft_loops, n_draft, loops)
    except ValueError as exc:
        message = str(exc)
        raise RequestError(message, "n_draft" if message.startswith("n_draft") else "draft_loops"
                           ) from None


def _exit(body: Body, cfg: Mapping[str, Any], loops: Optional[int], n_draft: int
          ) -> tuple[Optional[str], Optional[float], Optional[int]]:
    """(exit_rule, exit_threshold, min_loops) of adaptive depth (docs/spec.md §5.7), checked
    by tinyloop.params' rules and resolved, or all None when the request has no rule; an
    error names the field it is about."""
    rule = _field(body, "exit_rule", str)
    threshold = _number(body, "exit_threshold", float, lambda v: v, None)
    min_loops = _number(body, "min_loops", int, lambda v: v, None)
    try:
        checked = P.check_exit(rule, threshold, min_loops,
                               cfg["default_loops"] if loops is None else loops, n_draft,
                               cfg["exit_threshold"] if cfg["exit_gate"] else None)
    except ValueError as exc:
        message = str(exc)
        field = next((name for name in ("exit_threshold", "min_loops") if message.startswith(name)),
                     "exit_rule")
        raise RequestError(message, field) from None
    return (None, None, None) if checked[0] == "none" else checked


def _check_fields(body: Body, known: set[str]) -> None:
    for name in body:
        if name in NEUTRAL:
            if body[name] not in (NEUTRAL[name], None):
                raise RequestError(f"{name} is not supported by this server; leave it out", name)
        elif name not in known:
            raise RequestError(f"unrecognized request argument supplied: {name}", name)


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of messages, got {_kind(messages)}",
                           "messages")
    rendered = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object, got {_kind(message)}", where)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}",
                               f"{where}.role")
        rendered.append({"role": ROLES[role], "content": _content(message.get("content"), where)})
    return rendered


def _content(content: Any, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise RequestError(f"{where}.content[{j}] must be a text part "
                                   '{"type": "text", "text": ...}; only text is supported',
                                   f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string or a list of text parts, got "
                       f"{_kind(content)}", f"{where}.content")


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of them", "stop")
    return tuple(stops)


def _encode(model: Model, text: str, field: str) -> list[int]:
    try:
        return model.encode(text)
    except ValueError as exc:                 # a model without a tokenizer
        raise RequestError(f"{field}: {exc}", field) from None


def _token_ids(model: Model, ids: list[Any]) -> list[int]:
    try:
        return [int(i) for i in P.check_tokens("prompt", ids, model.config()["vocab_size"])]
    except ValueError as exc:
        raise RequestError(str(exc), "prompt") from None


def _field(body: Body, name: str, kind: type, param: Optional[str] = None,
           required: bool = False) -> Any:
    """body[name] if it is a `kind` (None when absent or null, unless required)."""
    value = body.get(name)
    if value is None:
        if required:
            raise RequestError(f"{name} is required", param or name)
        return None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise RequestError(f"{param or name} must be a {kind.__name__}, got {_kind(value)}",
                           param or name)
    return value


def _instruction(body: Body, n_prompt: int) -> int:
    """instruction_length (docs/spec.md §4.1): the prompt tokens of the instruction block, an
    integer up to the prompt's token count or "prompt" for all of them; 0 when absent."""
    if body.get("instruction_length") == "prompt":
        return n_prompt

    def check(value: Any) -> int:
        length = P.check_int("instruction_length", value, 0)
        P.check_instruction(length, n_prompt)
        return length
    return int(_number(body, "instruction_length", int, check, 0))


def _number(body: Body, name: str, kind: type, check: Callable[[Any], Any],
            default: Any) -> Any:
    """A numeric field checked by `check` (tinyloop.params' rule and message); `default` when
    absent or null. An int field also takes a float with an integral value (JSON has one
    number type), as the OpenAI API does."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {_kind(value)}", name)
    if kind is int and isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise RequestError(f"{name} must be an integer, got {value!r}", name)
        value = int(value)
    try:
        return check(value)
    except ValueError as exc:
        raise RequestError(str(exc), name) from None


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), type(value).__name__)
