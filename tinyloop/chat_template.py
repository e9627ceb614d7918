"""Chat templates: a conversation rendered to the prompt text its model was trained on.

`ChatTemplate(source, special_tokens).render(messages, add_generation_prompt)` renders a
tokenizer_config.json `chat_template` the way transformers' apply_chat_template does: jinja2 in
an ImmutableSandboxedEnvironment (a template cannot reach Python), trim_blocks and
lstrip_blocks, the loopcontrols extension, the `{% generation %}` tag (rendered as its body),
`raise_exception(message)`, `strftime_now(format)`, a `tojson` that does not escape HTML, and
the special tokens (bos_token, eos_token, ...) as variables. Needs `jinja2` (a dependency of
the package, imported on the first render). Every failure is a ValueError naming what was wrong.
"""
from __future__ import annotations

import datetime
import functools
import importlib
import json
from typing import Any, Mapping, NoReturn, Sequence

MESSAGE_CONTENT_TYPES = (str, list, type(None))   # text, multimodal parts, a tool-call turn


def _jinja2() -> Any:
    try:
        return importlib.import_module("jinja2")
    except ImportError:
        raise ImportError("chat templates need the 'jinja2' package: "
                          "pip install jinja2") from None


def check_messages(messages: Any) -> None:
    """A conversation: a non-empty list of dicts, each with a string 'role' and, if present,
    a 'content' that is a string, a list (of content parts) or None."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got "
                             f"{type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}]['role'] must be a non-empty string, got {role!r}")
        content = message.get("content")
        if not isinstance(content, MESSAGE_CONTENT_TYPES):
            raise ValueError(f"messages[{i}]['content'] must be a string, a list of parts or "
                             f"None, got {type(content).__name__}")


def _raise_exception(message: str) -> NoReturn:
    raise _jinja2().exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _generation_tag(jinja2: Any) -> Any:
    """The `{% generation %}...{% endgeneration %}` tag of transformers' templates (it marks
    the assistant's tokens for training masks); here it renders its body."""

    class GenerationTag(jinja2.ext.Extension):  # type: ignore[misc]
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            block = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
            return block.set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    return GenerationTag


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    """The jinja2 template of `source` in transformers' environment (compiled once)."""
    jinja2 = _jinja2()
    importlib.import_module("jinja2.sandbox")
    importlib.import_module("jinja2.ext")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _generation_tag(jinja2)])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not compile (line {exc.lineno}): "
                         f"{exc.message}") from None
    except RecursionError:  # jinja2's parser recurses once per nested bracket
        raise ValueError("the chat template does not compile: it nests too deeply") from None


class ChatTemplate:
    """A chat template; `special_tokens` are its variables bos_token, eos_token, ... It is
    compiled on the first render, so a model whose template is never used needs no jinja2."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any]):
        self.source = source
        self._special_tokens = dict(special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The conversation as prompt text. `add_generation_prompt` appends the header that
        starts the assistant's reply; `variables` reach the template too (e.g. tools) and win
        over the special tokens, as in transformers."""
        template = _compile(self.source)
        check_messages(messages)
        context = {"messages": list(messages), "tools": None, "documents": None,
                   "add_generation_prompt": bool(add_generation_prompt),
                   **self._special_tokens, **variables}
        try:
            return str(template.render(**context))
        except _jinja2().exceptions.TemplateError as exc:
            raise ValueError(f"the chat template refused the messages: {exc}") from None
        except Exception as exc:  # the template's own bug (1 / 0, + on a string): its fault
            raise ValueError(f"the chat template failed on the messages: {type(exc).__name__}: "
                             f"{exc}") from None
