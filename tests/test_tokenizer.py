"""Tokenizers: a model's "hf" tokenizer (tokenizer.json in the file) against the `tokenizers`
package and transformers, the add_bos_token/add_eos_token rule, streamed text, `tinyloop
generate` on an "hf" model, the byte tokenizer as before, and the errors."""
import io
import json
import sys

import pytest

import tinyloop
from tinyloop.cli import main
from tinyloop.tokenizer import TextStream
from conftest import require_backend
from tiny_hf import SPECIAL_TOKENS, VOCAB, hf_model, tiny_tokenizer, tokenizer_config

TEXTS = ["hello world", "the quick brown fox, naïve café", "système wörld: ünïcödé ✓ 漢字",
         "  leading and trailing spaces  ", "<|user|>hi<|end|> </s> special tokens in text", ""]


def open_model(path, **kwargs):
    return tinyloop.Model(path, backend="numpy", **kwargs)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(Model of a file with the tiny tokenizer and no add_*_token flags, the tokenizer)."""
    tok = tiny_tokenizer()
    path = hf_model(tmp_path_factory.mktemp("hf") / "m.tinyloop", tok)
    with open_model(path) as model:
        yield model, tok


def test_encode_and_decode_are_the_tokenizers_package(hf):
    model, tok = hf
    for text in TEXTS:
        assert model.encode(text) == tok.encode(text).ids            # post-processor: <s> first
        assert model.encode(text, add_special_tokens=False) == tok.encode(
            text, add_special_tokens=False).ids
        ids = model.encode(text)
        assert model.decode(ids) == tok.decode(ids, skip_special_tokens=False)
        assert model.decode(ids, skip_special_tokens=True) == tok.decode(ids)
    assert model.decode(model.encode(TEXTS[2], add_special_tokens=False)) == TEXTS[2]
    assert model.encode("hi")[0] == model.config()["bos_id"] == tok.token_to_id("<s>")


def test_the_tokenizer_is_the_one_in_the_file_when_it_was_opened(tmp_path):
    """The meta texts are read at open, like the weights: replacing the file afterwards changes
    neither, and a closed model refuses text calls as it refuses the rest."""
    original, other = tiny_tokenizer(), tiny_tokenizer(decoder="metaspace")
    path = tmp_path / "m.tinyloop"
    for backend in ("numpy", "native"):
        require_backend(backend)
        hf_model(path, original)
        model = tinyloop.Model(path, backend=backend)
        hf_model(path, other)                   # another tokenizer at that path, before any text
        want = original.encode(TEXTS[1]).ids
        assert model.encode(TEXTS[1]) == want != other.encode(TEXTS[1]).ids
        model.close()
        with pytest.raises(RuntimeError, match="model was closed"):
            model.encode("hi")


def test_ids_of_a_padded_vocabulary_decode_to_nothing(hf):
    model, tok = hf
    assert tok.get_vocab_size() < VOCAB
    ids = model.encode("hello")
    assert model.decode(ids + [VOCAB - 1]) == model.decode(ids)
    with pytest.raises(ValueError, match=f"token id {VOCAB} at index 0 is out of range"):
        model.decode([VOCAB])


@pytest.mark.parametrize("add_bos", [True, False, None])
@pytest.mark.parametrize("add_eos", [True, False, None])
def test_add_bos_and_eos_token_as_transformers_llama_tokenizer(tmp_path, add_bos, add_eos):
    """encode as transformers' LlamaTokenizerFast given the flags the rule implies: those set,
    an absent one false; with none set, tokenizer.json's post-processor (here: <s> first)."""
    import transformers
    flags = {key: value for key, value in (("add_bos_token", add_bos), ("add_eos_token", add_eos))
             if value is not None}
    path = hf_model(tmp_path / "m.tinyloop", config_text=tokenizer_config(**flags))
    want_bos, want_eos = (bool(add_bos), bool(add_eos)) if flags else (True, False)
    reference = transformers.LlamaTokenizerFast(
        tokenizer_object=tiny_tokenizer(), bos_token="<s>", eos_token="</s>", legacy=False,
        add_bos_token=want_bos, add_eos_token=want_eos)
    with open_model(path) as model:
        for text in TEXTS:
            ids = model.encode(text)
            assert ids == reference(text)["input_ids"]
            assert (ids[:1] == [0]) == want_bos and (ids[-1:] == [1]) == want_eos
            assert model.encode(text, add_special_tokens=False) == reference(
                text, add_special_tokens=False)["input_ids"]


def test_special_tokens_from_tokenizer_config_else_the_header(tmp_path):
    """bos/eos: tokenizer_config's bos_token/eos_token (string or AddedToken object), else the
    header's bos_id/eos_id."""
    tok = tiny_tokenizer()
    ids = {token: tok.token_to_id(token) for token in SPECIAL_TOKENS}
    named = hf_model(tmp_path / "named.tinyloop", tok, config_text=json.dumps(
        {"bos_token": {"content": "<|system|>"}, "eos_token": "<|end|>"}))
    with open_model(named) as model:
        assert (model.tokenizer.bos_id, model.tokenizer.eos_id) == (ids["<|system|>"], ids["<|end|>"])
        assert model.tokenizer.special_tokens == {"bos_token": "<|system|>", "eos_token": "<|end|>"}
    header = hf_model(tmp_path / "header.tinyloop", tok, config_text=None,
                      bos_id=ids["<|user|>"], eos_id=ids["<|assistant|>"])
    with open_model(header) as model:
        assert (model.tokenizer.bos_id, model.tokenizer.eos_id) == (ids["<|user|>"],
                                                                      ids["<|assistant|>"])
        assert model.tokenizer.chat_template is None


@pytest.mark.parametrize("decoder", ["byte-level", "metaspace"])
def test_text_stream_adds_up_to_the_decoded_continuation(decoder):
    """The pieces a TextStream emits for ids pushed one at a time: no piece ends in half a
    character, and together they are the text the continuation adds to the prompt's (the
    SentencePiece-style decoder drops a leading space only at the start of a sequence)."""
    tok = tiny_tokenizer(decoder)
    decode = tok.decode
    prompt = tok.encode("hello the", add_special_tokens=False).ids
    continuation = tok.encode(" quick naïve système wörld 漢字 ✓", add_special_tokens=False).ids
    stream = TextStream(decode, prompt)
    pieces = [stream.push(token) for token in continuation] + [stream.flush()]
    assert "".join(pieces) == decode(prompt + continuation)[len(decode(prompt)):]
    assert not any(piece.endswith("\ufffd") for piece in pieces)
    assert sum(1 for piece in pieces if piece) > len(continuation) // 2    # streamed, not held


def test_text_stream_flushes_what_never_completes():
    stream = TextStream(lambda ids: bytes(ids).decode("utf-8", "replace"))
    assert [stream.push(token) for token in "é".encode()[:1]] == [""]   # half a character
    assert stream.flush() == "\ufffd"


def test_byte_tokenizer_as_before(tmp_path):
    path = tmp_path / "bytes.tinyloop"
    tinyloop.random_model(path, tokenizer="bytes", vocab_size=256)
    for model_path in (None, path):                 # the demo model, and one with no meta.*
        with open_model(model_path) as model:
            text = "naïve ✓\n"
            assert model.encode(text) == list(text.encode()) == model.encode(text, False)
            assert model.decode(list(text.encode())) == text
            assert model.decode(list(text.encode()), skip_special_tokens=True) == text
            assert model.decode(list(text.encode())[:-2]) == "naïve \ufffd"
    with open_model(path) as model:
        assert model.tokenizer.end_of_turn_id is None
        with pytest.raises(ValueError, match="has no chat template"):
            model.apply_chat_template([{"role": "user", "content": "hi"}])


def test_the_demo_model_has_a_chat_template_and_ends_a_turn_at_a_newline():
    """Its tokenizer_config: each message is a line (the system message is followed by a blank
    line, as a book's title is), and the reply is the next line."""
    with open_model(None) as model:
        messages = [{"role": "system", "content": "The Gospel According to Saint John "},
                    {"role": "user", "content": " In the beginning was the Word."},
                    {"role": "assistant", "content": "And the Word was with God."}]
        assert model.apply_chat_template(messages) == (
            "The Gospel According to Saint John\n\nIn the beginning was the Word.\n"
            "And the Word was with God.\n")
        assert model.tokenizer.end_of_turn_id == ord("\n")
        assert model.tokenizer.eos_id is None          # the header's: generate stops nowhere


@pytest.mark.parametrize("config_text, message", [
    (json.dumps({"eos_token": "<|end|>"}), "eos_token of a bytes tokenizer must be one byte"),
    (json.dumps({"eos_token": "é"}), "must be one byte"),
    (json.dumps({"chat_template": 3}), "chat_template must be a string"),
    ("[1]", "must be a JSON object"),
])
def test_a_bytes_models_bad_tokenizer_config_is_refused(tmp_path, config_text, message):
    path = tmp_path / "bad.tinyloop"
    tinyloop.random_model(path, tokenizer="bytes", vocab_size=256,
                          meta={"meta.tokenizer_config": config_text})
    with open_model(path) as model:
        with pytest.raises(tinyloop.ModelFormatError, match=message):
            model.tokenizer


def test_generate_on_an_hf_model_streams_the_decoded_text(hf, monkeypatch):
    model, tok = hf
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    prompt = "the quick brown"
    code = main(["generate", prompt, "--model", model.path, "--backend", "numpy",
                 "--max-tokens", "12", "--temperature", "0"], out=out)
    assert code == 0, err.getvalue()
    ids = model.encode(prompt)
    want = model.generate(ids, max_tokens=12)
    text = model.decode(want, skip_special_tokens=True)
    assert out.getvalue() == prompt + text[len(model.decode(ids, skip_special_tokens=True)):] + "\n"
    assert f"prompt {len(ids)} tokens" in err.getvalue()


def test_generate_stop_text_is_encoded_without_special_tokens(hf, monkeypatch):
    """--stop TEXT stops at the text's own ids: no <s> is put before them."""
    model, _ = hf
    ids = model.encode("hello")
    first = model.generate(ids, max_tokens=8)[len(ids):]
    end = next(end for end in range(2, len(first) + 1)          # a stop that re-encodes
               if model.encode(model.decode(first[end - 2:end]), False) == first[end - 2:end])
    stop = model.decode(first[end - 2:end])
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert main(["generate", "hello", "--model", model.path, "--backend", "numpy", "--max-tokens",
                 "8", "--temperature", "0", "--stop", stop], out=out) == 0
    assert out.getvalue() == "hello" + model.decode(first[:end], skip_special_tokens=True) + "\n"


def test_models_without_a_tokenizer_refuse_text(model_files):
    with open_model(model_files["int8-gqa"]) as model:
        for call in (lambda: model.encode("hi"), lambda: model.decode([1]),
                     lambda: model.apply_chat_template([{"role": "user", "content": "hi"}])):
            with pytest.raises(ValueError, match=r"has no tokenizer \(tokenizer='none'\); pass "
                                                 "token ids"):
                call()


def test_missing_optional_packages_say_how_to_install(tmp_path, monkeypatch):
    path = hf_model(tmp_path / "m.tinyloop",
                    config_text=tokenizer_config(chat_template="{{ messages | length }}"))
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "tokenizers", None)          # import tokenizers fails
        with open_model(path) as model:
            with pytest.raises(ImportError, match=r"'tokenizers' package: pip install "
                                                  r"'tinyloop\[hf\]'"):
                model.encode("hi")
            assert model.generate([1, 2], max_tokens=2)         # token ids still work
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with open_model(path) as model:
        assert model.decode(model.encode("hi")) == "<s>hi"    # no template, no jinja2 needed
        with pytest.raises(ImportError, match=r"chat templates need the 'jinja2' package: pip "
                                              r"install jinja2"):
            model.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("config_text, message", [
    ("[1, 2]", "meta.tokenizer_config must be a JSON object, got list"),
    ("{", "meta.tokenizer_config is not JSON"),
    (json.dumps({"eos_token": 5}), "eos_token must be a string or an object"),
    (json.dumps({"bos_token": None, "add_bos_token": True}), "sets add_bos_token but has no bos_token"),
    (json.dumps({"add_eos_token": "yes"}), "add_eos_token must be true or false"),
    (json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}]}),
     "chat_template must be a string or a list of {name, template} with a 'default' one"),
])
def test_bad_tokenizer_config_is_named(tmp_path, config_text, message):
    path = hf_model(tmp_path / "m.tinyloop", config_text=config_text, bos_id=-1)
    with open_model(path) as model:
        with pytest.raises(ValueError, match=message):
            model.encode("hi")


def test_special_tokens_become_added_tokens_as_in_transformers(tmp_path):
    """A special token of tokenizer_config that tokenizer.json does not list as an added token
    becomes one: matched whole inside words, dropped by skip_special_tokens; a new one takes
    the next id (transformers does the same when it loads the pair of files)."""
    import transformers
    tok = tiny_tokenizer()
    config_text = json.dumps({"bos_token": "<s>", "pad_token": "ick", "unk_token": "<new>"})
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer(), bos_token="<s>", pad_token="ick", unk_token="<new>")
    with open_model(hf_model(tmp_path / "m.tinyloop", tok, config_text=config_text)) as model:
        assert model.tokenizer.special_tokens == {"bos_token": "<s>", "pad_token": "ick",
                                                  "unk_token": "<new>", "eos_token": "</s>"}
        for text in ("the quick brown fox", "quickly <new> icky"):
            ids = model.encode(text)
            assert ids == reference(text)["input_ids"]
            assert model.decode(ids, skip_special_tokens=True) == reference.decode(
                ids, skip_special_tokens=True)
        assert model.encode("<new>") == [0, tok.get_vocab_size()]


@pytest.mark.parametrize("config_text, vocab_size, size", [
    (None, 256, 300), (json.dumps({"unk_token": "<new>"}), 300, 301)])
def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, config_text, vocab_size,
                                                          size):
    path = hf_model(tmp_path / "m.tinyloop", vocab_size=vocab_size, config_text=config_text)
    with open_model(path) as model:
        with pytest.raises(tinyloop.ModelFormatError,
                           match=f"meta.tokenizer_json has {size} tokens .*, more than the "
                                 f"model's vocab_size {vocab_size}"):
            model.encode("hi")


@pytest.mark.parametrize("after, expected", [
    ("<|end|>", "<|end|>"),              # the special token written right after a reply
    ("\n <|end|>\n", "<|end|>"),         # whitespace before it (byte-level BPE tokens)
    ("!<|end|>", "</s>"),                # text first: not an end of turn, eos instead
    ("", "</s>"),                        # nothing after a reply
])
def test_end_of_turn_is_the_token_the_template_writes_after_a_reply(tmp_path, after, expected):
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}" + after
                + "{% endfor %}")
    path = hf_model(tmp_path / "m.tinyloop", config_text=tokenizer_config(chat_template=template))
    with open_model(path) as model:
        assert model.tokenizer.end_of_turn_id == tiny_tokenizer().token_to_id(expected)


@pytest.mark.parametrize("template", [
    "{{ raise_exception('no replies here') }}",
    "{% for m in messages %}<|{{ m['role'] }}|><|end|>{% endfor %}",     # drops every content
])
def test_a_template_that_refuses_or_drops_a_reply_leaves_eos_as_the_end_of_turn(tmp_path,
                                                                                  template):
    path = hf_model(tmp_path / "m.tinyloop", config_text=tokenizer_config(chat_template=template))
    with open_model(path) as model:
        assert model.tokenizer.end_of_turn_id == tiny_tokenizer().token_to_id("</s>")


@pytest.mark.parametrize("template, message", [
    ("{{ messages[0]['content'] + 1 }}", "the chat template failed on the messages: TypeError"),
    ("{{ 1 // 0 }}", "the chat template failed on the messages: ZeroDivisionError"),
    ("{{ x" + "[" * 200 + " }}", "the chat template does not compile: it nests too deeply"),
])
def test_a_template_that_crashes_is_a_value_error_and_leaves_eos_as_the_end_of_turn(
        tmp_path, template, message):
    """Found by fuzzing the tokenizer metadata (libtinyloop/tests/fuzz/fuzz_python.py): a
    template's own bug used to escape as TypeError, ZeroDivisionError or RecursionError."""
    path = hf_model(tmp_path / "m.tinyloop", config_text=tokenizer_config(chat_template=template))
    with open_model(path) as model:
        assert model.tokenizer.end_of_turn_id == tiny_tokenizer().token_to_id("</s>")
        with pytest.raises(ValueError, match=message):
            model.tokenizer.chat_template.render([{"role": "user", "content": "hi"}])


def test_a_tokenizer_json_the_tokenizers_package_cannot_run_is_refused(tmp_path):
    """Found by fuzzing: tokenizers accepts a post-processor naming a special token the file
    does not define, then panics on every encode (pyo3's PanicException, a BaseException):
    a ModelFormatError naming the file instead."""
    tok = json.loads(tiny_tokenizer().to_str())
    specials = tok["post_processor"]["special_tokens"]
    specials["<r>"] = specials.pop("<s>")
    path = tmp_path / "m.tinyloop"
    tinyloop.random_model(path, seed=7, meta={"meta.tokenizer_json": json.dumps(tok)},
                          vocab_size=VOCAB, tokenizer="hf", max_seq_len=64)
    with open_model(path) as model:
        with pytest.raises(tinyloop.ModelFormatError,
                           match="meta.tokenizer_json: the tokenizers package cannot run it"):
            model.encode("hi")


def test_a_bytes_model_skips_its_stop_ids_when_asked(tmp_path):
    path = tmp_path / "b.tinyloop"
    tinyloop.random_model(path, vocab_size=300, tokenizer="bytes", eos_id=256,
                          stop_ids=(257, ord("!")))
    with open_model(path) as model:
        assert model.decode([72, 105, 33, 257, 256], skip_special_tokens=True) == "Hi"
        assert model.decode([72, 105, 33]) == "Hi!"              # text unless skipped
        with pytest.raises(ValueError, match="257"):
            model.decode([72, 257])
