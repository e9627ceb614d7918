"""The bundled demo model (tinyloop/data/demo.tinyloop, docs/demo_model.md).

It loads and validates, has the documented config, writes mostly-English bytes, and is a trained
model: its loss on held-out KJV text (Mark 3:9-12, never seen in training) is far below what a
random or unigram model gets, and looping helps (depth 6 beats depth 1).
"""
import math
import os

import numpy as np
import pytest

import tinyloop
from tinyloop.modelfile import load_model

DEMO_PATH = os.path.join(os.path.dirname(tinyloop.__file__), "data", "demo.tinyloop")
MAX_BYTES = 5 * 1024 * 1024

# Held out from training (tools/demo_corpus.py holds out every 40th chapter).
HELD_OUT = (
    "And he spake to his disciples, that a small ship should wait on him because of the "
    "multitude, lest they should throng him.\n"
    "For he had healed many; insomuch that they pressed upon him for to touch him, as many as "
    "had plagues.\n"
    "And unclean spirits, when they saw him, fell down before him, and cried, saying, Thou art "
    "the Son of God.\n"
    "And he straitly charged them that they should not make him"
).encode("ascii")
# Measured on the shipped file: 1.682 bits/byte at depth 6, 1.758 at depth 1. A uniform model
# scores 8, a byte-unigram model about 4.4, the model shipped before this one 1.707.
MAX_BPB_DEFAULT_DEPTH = 1.80
MIN_DEPTH_GAIN_BPB = 0.04


@pytest.fixture(scope="module")
def demo():
    with tinyloop.Model(DEMO_PATH, backend="numpy") as model:
        yield model


def bits_per_byte(logits, targets):
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(targets)), targets].mean() / math.log(2))


def test_file_loads_validates_and_is_small():
    assert os.path.getsize(DEMO_PATH) <= MAX_BYTES
    config, tensors = load_model(DEMO_PATH)        # checks every rule of spec §6
    assert set(tensors) == {*config.required_tensors(), "meta.tokenizer_config"}   # its chat


def test_config_is_documented(demo):
    c = demo.config()
    assert c["name"] == "tinyloop-demo"
    assert c["tokenizer"] == "bytes" and c["vocab_size"] == 256
    assert c["bos_id"] == -1 and c["eos_id"] == -1
    assert c["weight_format"] == "int8"
    assert (c["d_model"], c["n_heads"], c["n_kv_heads"], c["head_dim"], c["ffn_dim"]) == \
        (256, 4, 2, 64, 704)
    assert c["n_pre_blocks"] == 1 and c["default_loops"] == 6
    assert c["max_seq_len"] >= 1024


def test_greedy_generation_is_english_like(demo):
    prompt = list(b"The ")
    out = demo.generate(prompt, max_tokens=80)
    assert all(32 <= b < 127 or b == 10 for b in out[len(prompt):]), out
    text = bytes(out[len(prompt):]).decode("ascii")
    wordy = sum(ch.isalpha() or ch in " \n.,;:'?!" for ch in text)
    assert wordy >= 0.8 * len(text), text
    assert any(w in text.split() for w in ("the", "and", "of", "LORD", "unto")), text


def test_held_out_loss(demo):
    tokens = np.frombuffer(HELD_OUT, np.uint8).astype(np.int64)
    default = bits_per_byte(demo.logits(tokens[:-1]), tokens[1:])
    shallow = bits_per_byte(demo.logits(tokens[:-1], loops=1), tokens[1:])
    assert default < MAX_BPB_DEFAULT_DEPTH
    assert default < shallow - MIN_DEPTH_GAIN_BPB
