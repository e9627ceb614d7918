"""Chat templates and chats: apply_chat_template against transformers' rendering, the sandbox
and the errors; `Chat` and `tinyloop chat` reuse the earlier turns' KV from the prefix cache
and reply exactly what a fresh generate of the same rendered prompt returns."""
import io
import json
import re

import pytest

import tinyloop
from tinyloop.chat import Chat
from tinyloop.cli import main
from tiny_hf import CHAT_TEMPLATE, hf_model, tiny_tokenizer, tokenizer_config

SYSTEM = "you are a tiny looped model; answer briefly, exactly and in a single line of text"
CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "  be brief  "}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello wörld"}, {"role": "user", "content": "naïve?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "system", "content": "a later system turn is an ordinary one"}],
]
# What a real template uses besides CHAT_TEMPLATE's features: tojson (transformers' version,
# which does not escape HTML), the {% generation %} tag, variables passed through, eos_token.
TOOLS_TEMPLATE = """{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}
{% for message in messages %}
{% if message.role == 'assistant' %}{% generation %}{{ message.content }}{{ eos_token }}{% endgeneration %}
{% else %}[{{ message.role }}] {{ message.content | tojson }}
{% endif %}
{% endfor %}"""
TOOLS = [{"name": "search", "description": "finds <b>café</b> & co", "parameters": {}}]


def open_model(path, **kwargs):
    return tinyloop.Model(path, backend="numpy", **kwargs)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return hf_model(tmp_path_factory.mktemp("chat") / "m.tinyloop")


@pytest.fixture(scope="module")
def model(path):
    with open_model(path) as m:
        yield m


def transformers_tokenizer(chat_template):
    import transformers
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer(), bos_token="<s>", eos_token="</s>",
        chat_template=chat_template)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(model, messages, add_generation_prompt):
    reference = transformers_tokenizer(CHAT_TEMPLATE)
    text = model.apply_chat_template(messages, add_generation_prompt)
    assert text == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert model.apply_chat_template(messages, add_generation_prompt, tokenize=True) == \
        reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text.endswith("<|assistant|>") == add_generation_prompt


def test_tojson_generation_tag_and_variables_as_transformers(tmp_path):
    path = hf_model(tmp_path / "m.tinyloop",
                    config_text=tokenizer_config(chat_template=TOOLS_TEMPLATE))
    reference = transformers_tokenizer(TOOLS_TEMPLATE)
    with open_model(path) as model:
        for tools in (None, TOOLS):
            for messages in CONVERSATIONS:
                text = model.apply_chat_template(messages, tools=tools)
                assert text == reference.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert "<b>café</b>" in model.apply_chat_template(CONVERSATIONS[0], tools=TOOLS)


def test_a_list_of_named_templates_uses_the_default_one(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHAT_TEMPLATE}]
    path = hf_model(tmp_path / "m.tinyloop", config_text=tokenizer_config(chat_template=named))
    with open_model(path) as named_model, open_model(hf_model(tmp_path / "one.tinyloop")) as one:
        assert named_model.apply_chat_template(CONVERSATIONS[1]) == one.apply_chat_template(
            CONVERSATIONS[1])


@pytest.mark.parametrize("messages, message", [
    ("hello", "messages must be a list of {'role': ..., 'content': ...} dicts, got str"),
    ([], "messages is empty"),
    ([("user", "hi")], r"messages\[0\] must be a dict with 'role' and 'content', got tuple"),
    ([{"role": "user", "content": "a"}, {"content": "b"}],
     r"messages\[1\]\['role'\] must be a non-empty string, got None"),
    ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\] must be a string, a list of "
                                       "parts or None, got int"),
    ([{"role": "robot", "content": "hi"}],
     "the chat template refused the messages: unknown role: robot"),     # raise_exception
])
def test_bad_messages_are_named(model, messages, message):
    with pytest.raises(ValueError, match=message):
        model.apply_chat_template(messages)


@pytest.mark.parametrize("template", [
    "{{ messages.append({'role': 'x'}) }}",                       # immutable: no mutation
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",            # sandboxed: no Python internals
])
def test_the_template_runs_in_an_immutable_sandbox(tmp_path, template):
    path = hf_model(tmp_path / "m.tinyloop", config_text=tokenizer_config(chat_template=template))
    with open_model(path) as model:
        with pytest.raises(ValueError, match="the chat template refused the messages: .*unsafe"):
            model.apply_chat_template(CONVERSATIONS[0])


def test_a_template_that_does_not_compile_is_named(tmp_path):
    path = hf_model(tmp_path / "m.tinyloop",
                    config_text=tokenizer_config(chat_template="{{ bos_token }}\n{% for %}"))
    with open_model(path) as model:
        with pytest.raises(ValueError, match=r"the chat template does not compile \(line 2\): "):
            model.apply_chat_template(CONVERSATIONS[0])


def test_a_model_without_a_chat_template(tmp_path):
    path = hf_model(tmp_path / "m.tinyloop", config_text=json.dumps({"bos_token": "<s>"}))
    with open_model(path) as model:
        with pytest.raises(ValueError, match="has no chat template"):
            model.apply_chat_template(CONVERSATIONS[0])
        with pytest.raises(ValueError, match="a chat needs a chat template"):
            Chat(model)
    code = main(["chat", "--model", path, "--backend", "numpy"], out=io.StringIO())
    assert code == 2


def fresh_replies(path, system, user_lines, **generation):
    """The replies of a conversation computed without any cache: each turn's prompt rendered
    from the messages so far and generated by a Model whose prefix cache is off."""
    messages = [{"role": "system", "content": system}]
    replies = []
    with open_model(path, prefix_cache_bytes=0) as model:
        for line in user_lines:
            messages.append({"role": "user", "content": line})
            prompt = model.apply_chat_template(messages, tokenize=True)
            emitted = model.generate(prompt, **generation)[len(prompt):]
            replies.append(model.decode(emitted, skip_special_tokens=True))
            messages.append({"role": "assistant", "content": replies[-1]})
    return replies


def test_chat_reuses_the_earlier_turns_and_replies_as_a_fresh_generate(path, numpy_or_native):
    """On each engine with its own prefix cache, against numpy without a cache."""
    lines = ["hello, how are you?", "and the quick brown fox?"]
    with tinyloop.Model(path, backend=numpy_or_native) as model:
        chat = Chat(model, system=SYSTEM, max_tokens=12, temperature=0.8, seed=3)
        streamed = []
        turns = [chat.send(line, on_text=streamed.append) for line in lines]
    assert [turn.reply for turn in turns] == fresh_replies(
        path, SYSTEM, lines, max_tokens=12, temperature=0.8, seed=3)
    assert "".join(streamed) == "".join(turn.reply for turn in turns)
    assert turns[0].cached_tokens == 0 and turns[0].prefilled_tokens == turns[0].prompt_tokens
    second = turns[1]
    assert second.cached_tokens > turns[0].prompt_tokens // 2
    assert second.cached_tokens + second.prefilled_tokens == second.prompt_tokens
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert chat.messages[-1]["content"] == turns[1].reply


def test_chat_stops_at_the_tokenizers_end_of_turn_token(tmp_path):
    """With the header's eos_id unset, the tokenizer's eos_token still ends a reply."""
    path = hf_model(tmp_path / "m.tinyloop", eos_id=-1)
    messages = [{"role": "user", "content": "hello"}]
    with open_model(path) as model:
        prompt = model.apply_chat_template(messages, tokenize=True)
        emitted = model.generate(prompt, max_tokens=12)[len(prompt):]
    tok = tiny_tokenizer()
    at = next(i for i in range(1, len(emitted))                 # a token first seen there
              if emitted[i] not in emitted[:i] and emitted[i] < tok.get_vocab_size())
    end_of_turn = tok.id_to_token(emitted[at])
    path = hf_model(tmp_path / "eot.tinyloop", eos_id=-1, config_text=tokenizer_config(
        eos_token=end_of_turn))
    with open_model(path) as model:
        turn = Chat(model, max_tokens=12).send("hello")
    assert turn.new_tokens == at + 1


def test_cli_chat_over_piped_stdin(path, monkeypatch):
    lines = ["hello, how are you?", "and the quick brown fox?"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines + ["/exit", "never sent"]) + "\n"))
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    code = main(["chat", "--model", path, "--backend", "numpy", "--system", SYSTEM,
                 "--max-tokens", "12", "--temperature", "0.8", "--seed", "3"], out=out)
    assert code == 0, err.getvalue()
    replies = fresh_replies(path, SYSTEM, lines, max_tokens=12, temperature=0.8, seed=3)
    assert out.getvalue() == "".join(reply + "\n" for reply in replies)
    stats = re.findall(r"\[turn (\d+): prompt (\d+) tokens, (\d+) from the cache, (\d+) prefilled; "
                       r"(\d+) new tokens\]", err.getvalue())
    assert [int(turn[0]) for turn in stats] == [1, 2]
    (_, prompt1, hit1, _, _), (_, prompt2, hit2, filled2, _) = [map(int, s) for s in stats]
    assert hit1 == 0 and hit2 > 0 and hit2 + filled2 == prompt2 > prompt1


def test_the_demo_model_chats_out_of_the_box(monkeypatch):
    """`tinyloop chat` with no --model: the bundled demo model's template makes each message a
    line of verse and its end-of-turn byte ends each reply at the end of a line; a reply is
    what a fresh generate of the rendered conversation returns up to that byte."""
    lines = ["In the beginning was the Word, and the Word was with God.", "Who art thou?"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    code = main(["chat", "--system", "The Gospel According to Saint John", "--max-tokens", "200",
                 "--temperature", "0.7", "--seed", "2"], out=out)
    assert code == 0, err.getvalue()
    messages = [{"role": "system", "content": "The Gospel According to Saint John"}]
    replies, ended = [], []
    with tinyloop.Model(prefix_cache_bytes=0) as model:
        for line in lines:
            messages.append({"role": "user", "content": line})
            prompt = model.apply_chat_template(messages, tokenize=True)
            emitted = model.generate(prompt, max_tokens=200, temperature=0.7, seed=2)[len(prompt):]
            cut = emitted.index(10) if 10 in emitted else len(emitted)
            ended.append(cut < len(emitted))
            replies.append(model.decode(emitted[:cut]))
            messages.append({"role": "assistant", "content": replies[-1]})
    assert any(ended) and all(replies)                  # a turn really ended at its newline
    assert out.getvalue() == "".join(reply + "\n" for reply in replies)


# The word-level tokenizer of tests/hf_folders.py knows only w0 .. w269 (w0 is its unknown);
# bos w1 and eos w2 become added tokens, matched inside words too (w10 is w1 + unknown).
WORD_TEMPLATE = """{% set names = {'system': 'w3', 'user': 'w4', 'assistant': 'w5'} %}
{{ bos_token }}
{% for message in messages %}
{{ names[message.role] }} {{ message.content }} {{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}w5{% endif %}"""
WORD_SYSTEM = " ".join(f"w{i}" for i in range(30, 50))


def test_a_converted_hugging_face_folder_encodes_renders_and_chats_as_transformers(
        tmp_path, monkeypatch):
    """convert keeps the folder's tokenizer.json, tokenizer_config.json and chat_template.jinja;
    the converted model encodes and renders as transformers does reading the folder itself,
    and chats with cache hits from turn 2."""
    import transformers
    from hf_folders import checkpoint, write_folder
    config, tensors = checkpoint("LlamaForCausalLM")
    folder = write_folder(tmp_path / "llama", config, tensors, chat_template=WORD_TEMPLATE,
                          tokenizer_config={"tokenizer_class": "PreTrainedTokenizerFast",
                                            "bos_token": "w1", "eos_token": "w2"})
    path = str(tmp_path / "llama.tinyloop")
    tinyloop.convert(folder, path)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": WORD_SYSTEM}, {"role": "user", "content": "w7 w8"},
                {"role": "assistant", "content": "w9 nope"}, {"role": "user", "content": "w6"}]
    with open_model(path) as model:
        for text in ("w1 w5 w100", "w269 unknown w0"):
            assert model.encode(text) == reference(text)["input_ids"]
            assert model.decode(model.encode(text)) == reference.decode(reference(text)["input_ids"])
        for n in (2, 4):
            assert model.apply_chat_template(messages[:n]) == reference.apply_chat_template(
                messages[:n], tokenize=False, add_generation_prompt=True)
            assert model.apply_chat_template(messages[:n], tokenize=True) == \
                reference.apply_chat_template(messages[:n], add_generation_prompt=True)
    monkeypatch.setattr("sys.stdin", io.StringIO("w7 w8\nw6\n"))
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    assert main(["chat", "--model", path, "--backend", "numpy", "--system", WORD_SYSTEM,
                 "--max-tokens", "4", "--temperature", "0"], out=io.StringIO()) == 0, err.getvalue()
    hits = [int(n) for n in re.findall(r"(\d+) from the cache", err.getvalue())]
    assert len(hits) == 2 and hits[1] > 0


def test_chat_arguments_are_checked(model):
    with pytest.raises(ValueError, match=r"unknown generation argument\(s\) \['temprature'\]"):
        Chat(model, temprature=0.5)
    with pytest.raises(ValueError, match="max_tokens"):
        Chat(model, max_tokens=0)
    chat = Chat(model, max_tokens=510)
    with pytest.raises(RuntimeError, match=r"the conversation is \d+ tokens: with max_tokens 510 "
                                           "it exceeds the model's max_seq_len 512; start a new"):
        chat.send("hello")
    with pytest.raises(ValueError, match="the message must be a str, got int"):
        chat.send(5)
    assert chat.messages == []                     # a refused turn leaves no trace


def test_a_reply_ending_on_a_stop_id_leaves_it_out(tmp_path):
    """A stop id of a bytes model is a byte: generation ends on it (the model's own rule, not
    the chat's) and the reply's text leaves it out, as it leaves out an end of turn."""
    template = json.dumps({"chat_template": "{% for m in messages %}{{ m['content'] }}\n"
                                            "{% endfor %}"})
    shape = dict(vocab_size=256, tokenizer="bytes", seed=11,
                 meta={"meta.tokenizer_config": template})
    plain = tmp_path / "plain.tinyloop"
    tinyloop.random_model(plain, **shape)
    with open_model(plain) as model:
        prompt = model.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
        emitted = model.generate(prompt, max_tokens=8)[len(prompt):]
    at = next(i for i in range(1, len(emitted)) if emitted[i] not in emitted[:i])
    stopped = tmp_path / "stop.tinyloop"
    tinyloop.random_model(stopped, stop_ids=(emitted[at],), **shape)
    with open_model(stopped) as model:
        turn = Chat(model, max_tokens=8).send("hi")
    assert turn.new_tokens == at + 1
    assert turn.reply == bytes(emitted[:at]).decode("utf-8", "replace")
