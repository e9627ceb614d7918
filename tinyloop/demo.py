"""`tinyloop demo`, the main job, on the bundled demo model (docs/demo_model.md): one shared
system prompt and several requests, run without a prefix cache, with an explicit PrefixCache
and with the automatic prefix cache; the answers, a table of times, the reuse, and the check
that all three runs produced identical tokens (but with an h4 PrefixCache, an approximation:
docs/api.md, "Hidden-state prefixes", whose tokens are only reported)."""
from __future__ import annotations

from typing import Any, Callable, TextIO

from .model import DEFAULT_PREFIX_CACHE_BYTES, Model
from .quickbench import describe, timed

SYSTEM_PROMPT = ("In the beginning God created the heaven and the earth. And the earth was "
                 "without form, and void; and darkness was upon the face of the deep.\n")
REQUESTS = ("And God said", "And the LORD spake unto Moses, saying,", "Blessed are they",
            "And Jesus answered and said")


def run_demo(open_model: Callable[[int], Model], max_tokens: int, temperature: float, seed: int,
             out: TextIO) -> int:
    """open_model(prefix_cache_bytes) -> a Model of the demo; returns the exit code. A
    max_tokens the model cannot fit after the longest prompt raises ValueError before any
    output."""
    with open_model(0) as model, open_model(DEFAULT_PREFIX_CACHE_BYTES) as auto:
        cfg = model.config()
        system = model.encode(SYSTEM_PROMPT)
        requests = [model.encode(" " + r if i else r) for i, r in enumerate(REQUESTS)]
        longest = len(system) + max(map(len, requests))
        if longest + max_tokens > cfg["max_seq_len"]:
            raise ValueError(f"--max-tokens {max_tokens}: the longest demo prompt ({longest} "
                             f"tokens) leaves room for at most {cfg['max_seq_len'] - longest} "
                             f"new tokens (max_seq_len {cfg['max_seq_len']})")
        print(f"model {describe(cfg)}, backend {model.backend}\n", file=out)
        kw: dict[str, Any] = dict(max_tokens=max_tokens, temperature=temperature, seed=seed)
        plain, t_plain = timed(lambda: [model.generate(system + r, **kw) for r in requests])
        prefix, t_build = timed(lambda: model.build_prefix_cache(system))
        explicit, t_explicit = timed(lambda: [model.generate_from_prefix_cache(prefix, suffix=r, **kw)
                                               for r in requests])
        automatic, t_auto = timed(lambda: [auto.generate(system + r, **kw) for r in requests])
        for r, tokens in zip(requests, explicit):
            print(f"> {model.decode(r).strip()}{model.decode(tokens[len(system) + len(r):])}\n", file=out)
        stats = auto.cache_stats()
        n_prompt = sum(len(system) + len(r) for r in requests)
        rows = [("no prefix cache", t_plain, n_prompt, ""),
                ("PrefixCache (explicit)", t_build + t_explicit, len(system) + sum(map(len, requests)),
                 f"{prefix.storage} prefix built once in {t_build:.3f} s, {prefix.nbytes} bytes"),
                ("automatic prefix cache", t_auto, stats["prefilled_tokens"],
                 f"{stats['hit_tokens']} prompt tokens were cache hits")]
        print(f"{'run':<24}{'seconds':>9}{'speedup':>9}  prompt tokens computed", file=out)
        for name, seconds, computed, note in rows:
            print(f"{name:<24}{seconds:>9.3f}{t_plain / seconds:>8.2f}x  {computed:<6} {note}".rstrip(),
                  file=out)
        same = plain == automatic and (plain == explicit or prefix.storage == "h4")
        print(f"identical tokens with and without the cache: {'yes' if same else 'NO'}", file=out)
        if prefix.storage == "h4":
            print(f"the h4 PrefixCache's tokens equal them: {'yes' if plain == explicit else 'no'}",
                  file=out)
        return 0 if same else 1
