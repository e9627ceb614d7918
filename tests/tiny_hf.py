"""A tiny Hugging Face tokenizer and chat template, and random models that carry them (the
file layout a converted model has: tokenizer "hf", meta.tokenizer_json, meta.tokenizer_config).

The tokenizer is trained here with the `tokenizers` package (byte-level BPE, so every text
round-trips, and a multi-byte character can span tokens); tests compare TinyLoop's results
with that package and with transformers, never with values written down by hand.
"""
import json

import tokenizers

import tinyloop

SPECIAL_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CORPUS = ["hello world, this is a tiny corpus for a tiny tokenizer.",
          "the quick brown fox jumps over the lazy dog",
          "a looped transformer applies its core blocks again and again",
          "système, wörld, naïve café: bytes that span tokens"]
VOCAB = 320               # the model's vocab_size: the tokenizer's 300 ids and a padded tail
# A template in the style of real ones: a system turn, role checks, loop controls, whitespace
# control on both sides of tags, the special tokens as variables.
CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
    {% if loop.first and message['role'] == 'system' %}
<|system|>{{ message['content'] | trim }}<|end|>
        {% continue %}
    {% endif %}
<|{{ message['role'] }}|>{{ message['content'] }}<|end|>
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{%- endif %}"""


def tiny_tokenizer(decoder="byte-level"):
    """A trained BPE tokenizer (the `tokenizers` object). decoder "byte-level": GPT-2 style;
    "metaspace": SentencePiece style, whose decode drops the sequence's leading space."""
    t = tokenizers
    tok = t.Tokenizer(t.models.BPE())
    if decoder == "byte-level":
        tok.pre_tokenizer = t.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = t.decoders.ByteLevel()
        alphabet = t.pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = t.pre_tokenizers.Metaspace()
        tok.decoder = t.decoders.Metaspace()
        alphabet = []
    trainer = t.trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS,
                                    initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = t.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def tokenizer_config(**settings):
    """tokenizer_config.json text: <s> / </s>, the chat template, then `settings`."""
    return json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True},
                       "chat_template": CHAT_TEMPLATE, **settings})


DEFAULT_CONFIG_TEXT = tokenizer_config()


def hf_model(path, tok=None, config_text=DEFAULT_CONFIG_TEXT, **overrides):
    """Write a random model carrying `tok` (default: tiny_tokenizer()) and, unless None, the
    tokenizer_config text `config_text`; returns the path."""
    tok = tok or tiny_tokenizer()
    meta = {"meta.tokenizer_json": tok.to_str()}
    if config_text is not None:
        meta["meta.tokenizer_config"] = config_text
    fields = dict(vocab_size=VOCAB, tokenizer="hf", bos_id=tok.token_to_id("<s>"),
                  eos_id=tok.token_to_id("</s>"), max_seq_len=512, n_pre_blocks=1,
                  default_loops=2)
    tinyloop.random_model(path, seed=7, meta=meta, **{**fields, **overrides})
    return str(path)
