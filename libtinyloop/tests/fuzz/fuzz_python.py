"""Coverage-guided fuzzing of TinyLoop's Python readers with atheris (libFuzzer for Python).

  model_file, prefix_blob, block_file   the C targets' formats and seed corpora (corpus/<target>/),
        each input sealed as the C harness seals it and read by the reader readers_agree.py
        names; the reader accepts, or refuses with its documented error (ModelFormatError,
        PrefixFormatError, BlockFileError: ValueErrors naming the rule)
  tokenizer   a model file's tokenizer metadata (docs/spec.md §6.4): the input is the
        meta.tokenizer_config text, a NUL, then the meta.tokenizer_json text (seeds in
        corpus/tokenizer/, written by `python fuzz_python.py --write-tokenizer-seeds`); opening
        the Hugging Face tokenizer, encoding, decoding, finding the chat template's end of turn
        and rendering a chat either work or raise a ValueError naming the text at fault
Any other exception (IndexError, struct.error, TypeError, ZeroDivisionError, ...) is a finding,
and atheris saves its input.
usage: python fuzz_python.py TARGET [libFuzzer flags] [CORPUS_DIR ...]   (run_fuzz.sh --python)
"""
import os
import sys

import atheris

with atheris.instrument_imports(include=["tinyloop", "readers_agree"]):
    import tinyloop.chat_template  # noqa: F401  (instrumented before first use)
    import tinyloop.fallback.pcache_disk  # noqa: F401
    import tinyloop.fallback.prefix_blob  # noqa: F401
    import tinyloop.modelfile  # noqa: F401
    from tinyloop.config import ModelConfig
    from tinyloop.tokenizer import open_tokenizer
    from readers_agree import READERS, sealed

HERE = os.path.dirname(os.path.abspath(__file__))
# The model the tokenizer metadata belongs to: tests/tiny_hf.py's vocabulary, <s> and </s>.
TOKENIZER_MODEL = ModelConfig(vocab_size=320, d_model=8, n_heads=1, n_kv_heads=1, head_dim=8,
                              ffn_dim=8, n_pre_blocks=0, default_loops=1, max_seq_len=64,
                              weight_format="int8", group_size=0, tied_head=True, bos_id=1,
                              eos_id=2, tokenizer="hf")
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello <s> world"}]


def tokenizer_reader():
    """The tokenizer target's reader: everything a chat does with the metadata."""
    def read(data):
        config_text, sep, json_text = data.partition(b"\0")
        if not sep:
            return
        meta = {"meta.tokenizer_json": json_text.decode("utf-8", "replace"),
                "meta.tokenizer_config": config_text.decode("utf-8", "replace")}
        tokenizer = open_tokenizer(TOKENIZER_MODEL, meta)
        ids = tokenizer.encode("hello world </s> \u00e9")
        tokenizer.decode(ids)
        if tokenizer.end_of_turn_id is not None:
            assert 0 <= tokenizer.end_of_turn_id < TOKENIZER_MODEL.vocab_size
        if tokenizer.chat_template is not None:
            tokenizer.chat_template.render(CHAT)
    return read, (ValueError,)


def write_tokenizer_seeds():
    """corpus/tokenizer/: tests/tiny_hf.py's tokenizer with its chat template, and with none."""
    sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "tests"))
    import tiny_hf
    out = os.path.join(HERE, "corpus", "tokenizer")
    os.makedirs(out, exist_ok=True)
    tokenizer_json = tiny_hf.tiny_tokenizer().to_str().encode()
    for name, config_text in (("chat-template", tiny_hf.DEFAULT_CONFIG_TEXT), ("no-template", "{}")):
        with open(os.path.join(out, name), "wb") as f:
            f.write(config_text.encode() + b"\0" + tokenizer_json)


def main():
    readers = {**READERS, "tokenizer": tokenizer_reader}
    if sys.argv[1:] == ["--write-tokenizer-seeds"]:
        return write_tokenizer_seeds()
    if len(sys.argv) < 2 or sys.argv[1] not in readers:
        sys.exit(__doc__)
    target = sys.argv[1]
    read, refusals = readers[target]()

    def one_input(data):
        try:
            read(data if target == "tokenizer" else sealed(data))
        except refusals:
            pass

    atheris.Setup([sys.argv[0]] + sys.argv[2:], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
