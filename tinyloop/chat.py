"""`Chat`: a conversation with a chat model that keeps the earlier turns in the prefix cache.

Each turn renders the whole conversation with the model's chat template
(Model.apply_chat_template), generates the reply with Model.generate and keeps the reply's text
as the assistant's message. The prompt of turn n+1 starts with the prompt of turn n, so the
model's automatic prefix cache (on unless the Model was opened with prefix_cache_bytes=0)
serves those tokens' KV, block-aligned, and only the rest is prefilled; the reply is exactly
what a fresh `generate` of the same rendered prompt returns. `tinyloop chat` is this in a loop.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

from . import params as P
from .model import REQUEST_ARGUMENTS
from .tokenizer import TextStream, end_of_turn_stops

DEFAULT_MAX_TOKENS = 256


@dataclasses.dataclass(frozen=True)
class Turn:
    """One exchange. The token counts are the change of Model.cache_stats() over the turn."""

    reply: str              # the assistant's text, special tokens dropped
    prompt_tokens: int      # the rendered conversation
    cached_tokens: int      # of those, served by the prefix cache (hit_tokens)
    prefilled_tokens: int   # of those, computed (prefilled_tokens)
    new_tokens: int         # generated, a final end-of-turn token included


class Chat:
    """Chat(model, system=None, max_tokens=256, **generation): `system` (optional) is the first
    message; `generation` are Model.generate's keyword arguments for every reply (temperature,
    seed, loops, ...). The model's stop ids end a reply, and so do its tokenizer's end of turn
    (what its chat template writes after a reply) and eos token where those are other ids
    (tinyloop.tokenizer.end_of_turn_stops); none of them is part of the reply's text. `messages`
    is the conversation so far."""

    def __init__(self, model: Any, system: Optional[str] = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS, **generation: Any):
        unknown = sorted(set(generation) - set(REQUEST_ARGUMENTS))
        if unknown:
            raise ValueError(f"unknown generation argument(s) {unknown}")
        self.model = model
        self.messages: list[dict[str, Any]] = (
            [] if system is None else [{"role": "system", "content": system}])
        tokenizer = model.tokenizer           # ValueError for a model without a tokenizer
        if tokenizer.chat_template is None:
            raise ValueError(f"a chat needs a chat template; model {model.path!r} has none")
        end_of_turn = end_of_turn_stops(tokenizer, model.stop_token_ids())
        stops = [list(stop) for stop in generation.pop("stop_sequences", None) or ()]
        stops += [[token] for token in end_of_turn]
        self._ends = model.stop_token_ids() | set(end_of_turn)    # no part of a reply's text
        self._generation = dict(generation, stop_sequences=stops,
                                max_tokens=P.check_int("max_tokens", max_tokens, 1))
        self._decode = functools.partial(model.decode, skip_special_tokens=True)

    def send(self, text: str, on_text: Optional[Callable[[str], None]] = None) -> Turn:
        """Add the user message `text`, generate the reply and add it; on_text(piece), if
        given, receives the reply's text as it is generated (streaming)."""
        if not isinstance(text, str):
            raise ValueError(f"the message must be a str, got {type(text).__name__}")
        messages = self.messages + [{"role": "user", "content": text}]
        prompt = self.model.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
        max_seq_len, max_tokens = self.model.config()["max_seq_len"], self._generation["max_tokens"]
        if len(prompt) + max_tokens > max_seq_len:
            raise RuntimeError(f"the conversation is {len(prompt)} tokens: with max_tokens "
                               f"{max_tokens} it exceeds the model's max_seq_len {max_seq_len}; "
                               "start a new chat")
        stream = TextStream(self._decode, prompt)

        def show(piece: str) -> None:
            if piece and on_text is not None:
                on_text(piece)

        def on_token(token: int) -> None:
            if token not in self._ends:     # it ends the reply, and is no part of it
                show(stream.push(token))

        before = self.model.cache_stats()
        out = self.model.generate(prompt, **self._generation,
                                  on_token=None if on_text is None else on_token)
        after = self.model.cache_stats()
        show(stream.flush())
        emitted = out[len(prompt):]
        ended = bool(emitted) and emitted[-1] in self._ends
        reply = self._decode(emitted[:-1] if ended else emitted)
        self.messages = messages + [{"role": "assistant", "content": reply}]
        return Turn(reply, len(prompt), after["hit_tokens"] - before["hit_tokens"],
                    after["prefilled_tokens"] - before["prefilled_tokens"], len(emitted))
