"""Shared bench helpers: result files in bench/results/, and (from tinyloop.quickbench) the
standard shapes, their model files and timing."""
import datetime
import json
import platform
from pathlib import Path

from tinyloop.quickbench import SHAPES, best_of, bench_model as model_file

__all__ = ["RESULTS", "SHAPES", "best_of", "machine", "model_file", "write_results"]

RESULTS = Path(__file__).resolve().parent / "results"


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
