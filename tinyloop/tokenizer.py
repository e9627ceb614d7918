"""Text to token ids and back, for the tokenizer a model's header names (docs/spec.md §6.1).

`open_tokenizer(config, meta)` returns the model's `Tokenizer`: `ByteTokenizer` for "bytes"
(ids 0..255 are the UTF-8 bytes; meta.tokenizer_config, when the file has one, may give it a
chat_template and an end-of-turn byte), `HfTokenizer` for "hf" (the Hugging Face
`tokenizer.json` in meta.tokenizer_json, with meta.tokenizer_config's special tokens,
add_bos_token/add_eos_token and chat_template). `end_of_turn_stops` are the tokens a chat reply
ends on besides the model's stop ids, for `Chat` and the server alike. "hf" needs the optional
package `tokenizers` (pip install 'tinyloop[hf]'), imported only when such a tokenizer opens:
every other model works without it. `TextStream` turns ids, one at a time, into the text they
add (streaming). Text never reaches libtinyloop, which is token-in/token-out.
"""
from __future__ import annotations

import functools
import importlib
import json
from types import ModuleType
from typing import Any, Callable, Collection, Iterable, Mapping, Optional, Protocol, Sequence

from . import params as P
from .chat_template import ChatTemplate
from .config import ModelConfig
from .errors import ModelFormatError

# The keys of tokenizer_config.json that name special tokens: transformers' special-token
# attributes, handed to a chat template as variables (bos_token, eos_token, ...).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")
STREAM_CONTEXT = 5   # prompt tokens a TextStream decodes before the first new one
# An assistant message's content when a chat template is rendered to see what ends a turn.
END_OF_TURN_PROBE = "TinyLoopEndOfTurnProbe"


class Tokenizer(Protocol):
    """What a model's tokenizer does; `bos_id`/`eos_id` are None when it has no such token.
    `end_of_turn_id` is the token that ends a chat turn (the special token the chat template
    writes after a reply, else tokenizer_config's eos_token), None when the model has none."""

    bos_id: Optional[int]
    eos_id: Optional[int]
    chat_template: Optional[ChatTemplate]

    @property
    def end_of_turn_id(self) -> Optional[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


def open_tokenizer(config: ModelConfig, meta: Mapping[str, str]) -> Tokenizer:
    """The tokenizer of a model with this config and the file's meta.* texts `meta` (its
    tokenizer.json and tokenizer_config). ValueError for a model that has none (tokenizer
    "none")."""
    if config.tokenizer == "bytes":
        return ByteTokenizer(config, meta.get("meta.tokenizer_config"))
    if config.tokenizer == "hf":
        return HfTokenizer(meta["meta.tokenizer_json"], meta.get("meta.tokenizer_config"),
                           config)
    raise ValueError(f"model {config.name or 'unnamed'!r} has no tokenizer "
                     f"(tokenizer={config.tokenizer!r}); pass token ids")


def _optional_package(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ImportError(f"this model's Hugging Face tokenizer needs the {name!r} package: "
                          "pip install 'tinyloop[hf]'") from None


def _content(value: Any, key: str) -> Optional[str]:
    """A special token as tokenizer_config writes it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise ModelFormatError(f"meta.tokenizer_config {key} must be a string or an object with a "
                           f"'content' string, got {value!r}")


def _text(text: Any) -> str:
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    return text


def _header_id(value: int) -> Optional[int]:
    return value if value >= 0 else None


def _settings(text: Optional[str]) -> dict[str, Any]:
    """meta.tokenizer_config as a dict ({} when the file has none)."""
    if text is None:
        return {}
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"meta.tokenizer_config is not JSON: {exc}") from None
    if not isinstance(settings, dict):
        raise ModelFormatError("meta.tokenizer_config must be a JSON object, got "
                               f"{type(settings).__name__}")
    return settings


def _chat_template(settings: Mapping[str, Any], special_tokens: Mapping[str, Any]
                   ) -> Optional[ChatTemplate]:
    """tokenizer_config's chat_template (None when it has none): a string, or transformers'
    list of named templates, of which "default" is the chat template."""
    template = settings.get("chat_template")
    if template is None:
        return None
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template
                 if isinstance(entry, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise ModelFormatError("meta.tokenizer_config chat_template must be a string or a "
                               "list of {name, template} with a 'default' one")
    return ChatTemplate(template, special_tokens)


def end_of_turn_stops(tokenizer: Tokenizer, stop_ids: Collection[int]) -> list[int]:
    """The tokens that end a chat reply besides the model's stop ids (ModelConfig's
    stop_token_ids(), which end every generation): the tokenizer's end_of_turn_id and its
    eos_id, those that are not stop ids already (none, one or both)."""
    ends = (tokenizer.end_of_turn_id, tokenizer.eos_id)
    return list(dict.fromkeys(i for i in ends if i is not None and i not in stop_ids))


class ByteTokenizer:
    """ids 0..255 are the UTF-8 bytes of the text; the header's bos/eos ids and the file's stop
    ids are its special tokens. encode adds none of them (the byte models never had them
    added).

    A meta.tokenizer_config (optional) gives the model a chat template and an end of turn:
    its eos_token, one byte (the demo model's is "\\n": a reply is one line). That byte stays
    text: decode never drops it, and it is not eos_id, which is the header's."""

    def __init__(self, config: ModelConfig, tokenizer_config: Optional[str] = None):
        settings = _settings(tokenizer_config)
        self.bos_id = _header_id(config.bos_id)
        self.eos_id = _header_id(config.eos_id)
        self._special = {config.bos_id, *config.stop_token_ids()}
        end = _content(settings.get("eos_token"), "eos_token")
        if end is not None and len(end.encode("utf-8")) != 1:
            raise ModelFormatError("meta.tokenizer_config eos_token of a bytes tokenizer must "
                                   f"be one byte, got {end!r}")
        self.end_of_turn_id = None if end is None else end.encode("utf-8")[0]
        self.chat_template = _chat_template(
            settings, {} if end is None else {"eos_token": end})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(_text(text).encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Never raises on partial or invalid UTF-8 (U+FFFD); ids >= 256 are refused unless
        they are special (bos, eos, stop ids) and skip_special_tokens drops them."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special]
            if not ids:
                return ""
        return bytes(P.check_tokens("tokens", ids, 256).tolist()).decode("utf-8", "replace")


class _PanicsAsFormatErrors:
    """A `tokenizers.Tokenizer` whose methods turn a panic of the package's Rust code into
    ModelFormatError: it accepts some tokenizer.json files it then cannot run (a post-processor
    naming a special token the file does not define panics on every encode), and pyo3's
    PanicException is a BaseException that would escape every `except Exception`."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._tokenizer, name)

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except Exception:
                raise
            except BaseException as exc:
                if type(exc).__name__ != "PanicException":
                    raise
                raise ModelFormatError("meta.tokenizer_json: the tokenizers package cannot run "
                                       f"it ({name} failed: {exc})") from None
        return call


class HfTokenizer:
    """A Hugging Face fast tokenizer: `tokenizer.json` run by the `tokenizers` package.

    encode(text) is tokenizer.json's pipeline. Its post-processor adds the special tokens
    (as a transformers fast tokenizer does) unless tokenizer_config sets add_bos_token or
    add_eos_token: then, as transformers' LLaMA-family tokenizers do, exactly those flags decide
    (BOS first when add_bos_token is true, EOS last when add_eos_token is true, an absent flag
    being false). add_special_tokens=False adds none (chat templates write their own).
    The bos/eos tokens are tokenizer_config's bos_token/eos_token, else the header's bos_id/eos_id;
    tokenizer_config's special tokens are special added tokens, as transformers makes them.
    decode is the tokenizers package's decode (transformers' clean_up_tokenization_spaces is not
    applied).
    """

    def __init__(self, tokenizer_json: str, tokenizer_config: Optional[str], config: ModelConfig):
        tokenizers = _optional_package("tokenizers")
        try:
            self._tokenizer = _PanicsAsFormatErrors(tokenizers.Tokenizer.from_str(tokenizer_json))
        except Exception as exc:  # the Rust parser raises a bare Exception
            raise ModelFormatError(f"meta.tokenizer_json is not a tokenizer.json: {exc}") from None
        settings = _settings(tokenizer_config)
        # What a chat template sees as variables: transformers' special_tokens_map.
        self.special_tokens = self._named_special_tokens(settings)
        # As in transformers, a special token that tokenizer.json does not list among its added
        # tokens becomes one: matched whole in any text, kept out of decode when skipped; it
        # keeps its id if tokenizer.json has it, else it takes the next one.
        listed = {token.content for token in self._tokenizer.get_added_tokens_decoder().values()}
        named = [text for value in self.special_tokens.values()
                 for text in (value if isinstance(value, list) else [value])]
        self._tokenizer.add_special_tokens([text for text in dict.fromkeys(named)
                                            if text not in listed])
        size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        if size > config.vocab_size:
            raise ModelFormatError(f"meta.tokenizer_json has {size} tokens (with the special "
                                   "tokens of meta.tokenizer_config), more than the model's "
                                   f"vocab_size {config.vocab_size}")
        self._vocab_size = config.vocab_size
        for key, header_id in (("bos_token", config.bos_id), ("eos_token", config.eos_id)):
            token = self._tokenizer.id_to_token(header_id) if header_id >= 0 else None
            if key not in self.special_tokens and token is not None:
                self.special_tokens[key] = token
        self.bos_id = self._token_id("bos_token")
        self.eos_id = self._token_id("eos_token")
        self._added = self._special_flags(settings)
        self.chat_template = _chat_template(settings, self.special_tokens)

    @functools.cached_property
    def end_of_turn_id(self) -> Optional[int]:
        """The template's end of turn (_template_end_of_turn), else eos_id; found on first use,
        so a model whose template is never rendered needs no jinja2."""
        end = self._template_end_of_turn()
        return self.eos_id if end is None else end

    @staticmethod
    def _named_special_tokens(settings: Mapping[str, Any]) -> dict[str, Any]:
        """{key: token text} of the special tokens tokenizer_config names (a list of texts for
        additional_special_tokens)."""
        named: dict[str, Any] = {}
        for key in SPECIAL_TOKEN_KEYS:
            text = _content(settings.get(key), key)
            if text is not None:
                named[key] = text
        extra = settings.get("additional_special_tokens")
        if extra:
            if not isinstance(extra, list):
                raise ModelFormatError("meta.tokenizer_config additional_special_tokens must be "
                                       f"a list, got {extra!r}")
            texts = [_content(value, "additional_special_tokens") for value in extra]
            named["additional_special_tokens"] = [text for text in texts if text is not None]
        return named

    def _template_end_of_turn(self) -> Optional[int]:
        """The special token the chat template writes right after an assistant reply's content,
        whitespace aside (ChatML's <|im_end|>, Huginn's <|end_turn|>); None when it writes none
        there, or has no template, or the template refuses a user-assistant exchange."""
        if self.chat_template is None:
            return None
        exchange = [{"role": "user", "content": "?"},
                    {"role": "assistant", "content": END_OF_TURN_PROBE}]
        try:
            text = self.chat_template.render(exchange, add_generation_prompt=False)
        except ValueError:
            return None
        at = text.rfind(END_OF_TURN_PROBE)
        if at < 0:
            return None
        after = self._tokenizer.encode(text[at + len(END_OF_TURN_PROBE):].lstrip(),
                                       add_special_tokens=False).ids
        special = {i for i, token in self._tokenizer.get_added_tokens_decoder().items()
                   if token.special}
        return int(after[0]) if after and after[0] in special else None

    def _token_id(self, key: str) -> Optional[int]:
        text = self.special_tokens.get(key)
        token_id = None if text is None else self._tokenizer.token_to_id(text)
        return None if token_id is None else int(token_id)

    def _special_flags(self, settings: Mapping[str, Any]) -> Optional[tuple[list[int], list[int]]]:
        """(ids put first, ids put last) when add_bos_token/add_eos_token decide, else None."""
        flags = {key: settings.get(key) for key in ("add_bos_token", "add_eos_token")}
        if all(flag is None for flag in flags.values()):
            return None
        sides = []
        for key, token_id, name in (("add_bos_token", self.bos_id, "bos_token"),
                                    ("add_eos_token", self.eos_id, "eos_token")):
            if flags[key] not in (None, True, False):
                raise ModelFormatError(f"meta.tokenizer_config {key} must be true or false, "
                                       f"got {flags[key]!r}")
            if flags[key] and token_id is None:
                raise ModelFormatError(f"meta.tokenizer_config sets {key} but has no {name}")
            sides.append([token_id] if flags[key] and token_id is not None else [])
        return sides[0], sides[1]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._added is None or not add_special_tokens:
            encoding = self._tokenizer.encode(_text(text), add_special_tokens=add_special_tokens)
            return list(encoding.ids)
        first, last = self._added
        encoding = self._tokenizer.encode(_text(text), add_special_tokens=False)
        return first + list(encoding.ids) + last

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """ids the model has but tokenizer.json lacks (a padded vocabulary) decode to nothing."""
        checked = P.check_tokens("tokens", ids, self._vocab_size)
        return str(self._tokenizer.decode(checked.tolist(), skip_special_tokens))


class TextStream:
    """The text each new token adds to a decoded sequence, for printing as it is generated.

    Incremental detokenization as text-generation-inference does it: decode a short window of
    ids ending at the last one, with and without the new ids, and emit the difference once it
    no longer ends in an incomplete character (U+FFFD); a few ids of `context` (the prompt) come
    first so that a decoder that treats the sequence start specially (SentencePiece's leading
    space) sees the new text in place. flush() emits what is still held back.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], context: Iterable[int] = ()):
        self._decode = decode
        self._ids = list(context)[-STREAM_CONTEXT:]   # the window; earlier ids are done
        self._shown = len(self._ids)                  # the window's ids whose text was emitted

    def push(self, token: int) -> str:
        self._ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        shown = self._ids[:self._shown]
        before = self._decode(shown) if shown else ""
        after = self._decode(self._ids) if self._ids else ""
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._ids = self._ids[self._shown:]      # the next window starts at the ids just shown
        self._shown = len(self._ids)
        return after[len(before):]
