"""Shared bench helpers: result files in bench/results/, and (from tinyloop.quickbench) the
standard shapes, their model files and timing."""
import contextlib
import datetime
import json
import os
import platform
import signal
from pathlib import Path

import tinyloop
from tinyloop.backends import native_isas

from tinyloop.quickbench import SHAPES, best_of, bench_model as model_file

__all__ = ["RESULTS", "SHAPES", "best_of", "exit_text", "machine", "model_file", "tinyloop_isas",
           "tinyloop_model", "write_results"]

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
    if value is None:                   # a figure the row has not got (e.g. a crashed engine)
        return "—"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def exit_text(returncode):
    """How a worker process ended: 'signal 11, SIGSEGV' or 'exit code 1'."""
    if returncode < 0:
        return f"signal {-returncode}, {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def tinyloop_isas(wanted):
    """The TinyLoop kernel paths to bench: those named in `wanted` (comma-separated), or every one
    this CPU and libtinyloop have but scalar."""
    have = [isa for isa in native_isas() if isa != "scalar"]
    if not wanted:
        return have
    isas = wanted.split(",")
    if not set(isas) <= set(have) | {"scalar"}:
        raise SystemExit(f"--isas {wanted}: this CPU and libtinyloop run "
                         f"{', '.join(['scalar', *have])}")
    return isas


@contextlib.contextmanager
def tinyloop_model(path, isa, threads):
    """tinyloop.Model on `path` opened with TINYLOOP_ISA=isa (read when a Model opens)."""
    saved = os.environ.get("TINYLOOP_ISA")
    os.environ["TINYLOOP_ISA"] = isa
    try:
        model = tinyloop.Model(path, backend="native", threads=threads, prefix_cache_bytes=0)
    finally:
        if saved is None:
            del os.environ["TINYLOOP_ISA"]
        else:
            os.environ["TINYLOOP_ISA"] = saved
    with model:
        yield model
