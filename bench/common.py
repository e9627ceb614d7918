"""Shared bench helpers: the standard shapes, timing, and result files in bench/results/."""
import datetime
import json
import platform
import time
from pathlib import Path

import tinyloop

RESULTS = Path(__file__).resolve().parent / "results"

# The shapes every bench and issue refers to (n_pre 2, L 8, vocab 32000).
SHAPES = {
    "quick": dict(vocab_size=32000, d_model=512, n_heads=8, n_kv_heads=8, head_dim=64,
                  ffn_dim=1408, n_pre_blocks=2, default_loops=8, max_seq_len=2048),
    "full": dict(vocab_size=32000, d_model=2048, n_heads=16, n_kv_heads=16, head_dim=128,
                 ffn_dim=5632, n_pre_blocks=2, default_loops=8, max_seq_len=2048),
}


def model_file(shape, weight_format, cache_dir):
    """Path of a random model of a standard shape, written once into cache_dir."""
    path = Path(cache_dir) / f"{shape}-{weight_format}.tinyloop"
    if not path.exists():
        tinyloop.random_model(path, seed=0, weight_format=weight_format,
                              name=f"bench-{shape}-{weight_format}", **SHAPES[shape])
    return path


def best_of(fn, repeats):
    """(result, fastest wall time in seconds) over `repeats` runs."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return result, best


def machine():
    return f"{platform.machine()} {platform.processor() or platform.system()}, python {platform.python_version()}"


def write_results(name, rows, columns, notes=""):
    """Write bench/results/<name>.json and .md; returns the markdown table."""
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta = {"bench": name, "date": stamp, "machine": machine(), "notes": notes}
    (RESULTS / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# {name}", "", f"{stamp}, {machine()}. {notes}".rstrip(), "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row[c]) for c in columns) + " |")
    table = "\n".join(lines) + "\n"
    (RESULTS / f"{name}.md").write_text(table)
    return table


def _fmt(value):
    return f"{value:.2f}" if isinstance(value, float) else str(value)
