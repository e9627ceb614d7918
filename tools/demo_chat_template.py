"""The demo model's chat template: a conversation as the KJV text the model was trained on.

Contract:
    python tools/demo_chat_template.py [PATH]
        writes DEMO_TOKENIZER_CONFIG into the model file at PATH (default: the bundled
        tinyloop/data/demo.tinyloop) as its meta.tokenizer_config, replacing any there; the
        weights and the config are unchanged. tools/train_demo.py's export writes it too.

The model knows no roles, only lines of verse: each message is one line (the system message,
like a book's title, is followed by a blank line), and the reply is the next line, which the
end-of-turn byte "\\n" (eos_token) ends. So a chat with it is a call and response of verses.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tinyloop.bundled import DEMO_MODEL                   # noqa: E402
from tinyloop.modelfile import load_model, meta_tensor, save_model  # noqa: E402

CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{{ message['content'] | trim }}"
                 "{{ '\\n\\n' if message['role'] == 'system' else '\\n' }}"
                 "{% endfor %}")
DEMO_TOKENIZER_CONFIG = {"eos_token": "\n", "chat_template": CHAT_TEMPLATE}


def with_chat_template(tensors):
    """The model's tensors with meta.tokenizer_config set to DEMO_TOKENIZER_CONFIG."""
    text = json.dumps(DEMO_TOKENIZER_CONFIG, indent=1)
    return {**tensors, "meta.tokenizer_config": meta_tensor(text)}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else str(DEMO_MODEL)
    config, tensors = load_model(path)
    save_model(path, config, with_chat_template(tensors))
    print(f"wrote the chat template into {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
