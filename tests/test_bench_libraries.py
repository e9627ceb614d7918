"""bench/bench_libraries.py and bench_isa's int8 peaks on a tiny model: two builds (here the same
library twice) on every kernel path this CPU has, in alternating rounds, give one row per (build,
path, prompt), the first build's ratio 1 and the same tokens; the peak program measures exactly
the paths whose lscpu flag the CPU has and says why not for the others; --decode-batches adds
a decode table, one row per (build, path, batch)."""
import json
import sys
from pathlib import Path

import pytest

import tinyloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_isa  # noqa: E402
import bench_libraries as bench  # noqa: E402
import common  # noqa: E402


def test_the_int8_peaks_are_measured_on_the_paths_the_cpu_has():
    _, flags = common.cpu_description()
    peaks, missing = bench_isa.int8_peaks([1], flags)
    for isa, flag in bench_isa.PEAK_FLAGS.items():
        if flag in flags:
            assert isa not in missing and peaks[isa][1] > 0.01, missing.get(isa)
        else:
            assert isa not in peaks and missing[isa] == f"the CPU has no {flag} (lscpu flags)"


def test_two_builds_alternate_on_every_path(require_native, model_files, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    library = tinyloop.backend_info()["library"]
    isas = list(tinyloop.backends.native_isas())
    code = bench.main(["--library", f"one={library}", "--library", f"two={library}",
                       "--isas", ",".join(isas), "--model", str(model_files["int8-gqa"]),
                       "--prompts", "20,40", "--chunk", "16", "--threads", "1", "--rounds", "2",
                       "--repeats", "1", "--dir", str(tmp_path), "--name", "tiny",
                       "--decode-batches", "1,3"])
    rows = json.loads((tmp_path / "tiny.json").read_text())["rows"]
    assert code == 0 and all(row["same tokens"] for row in rows)
    assert [(r["isa"], r["prompt"], r["build"]) for r in rows] == [
        (isa, n, build) for isa in isas for n in (20, 40) for build in ("one", "two")]
    assert all(r["pp tok/s"] > 0 and r["prefill GMAC/s"] > 0 for r in rows)
    assert all(r["ratio"] == 1.0 for r in rows if r["build"] == "one")
    decode = json.loads((tmp_path / "tiny-decode.json").read_text())["rows"]
    assert [(r["isa"], r["batch"], r["build"]) for r in decode] == [
        (isa, b, build) for isa in isas for b in (1, 3) for build in ("one", "two")]
    assert all(r["ratio"] == 1.0 for r in decode if r["build"] == "one")
    assert all(r["vs smallest batch"] == 1.0 for r in decode if r["batch"] == 1)


def test_a_missing_build_or_a_prompt_past_the_model_is_refused_before_anything_runs(
        require_native, model_files, capsys):
    library = tinyloop.backend_info()["library"]
    model = str(model_files["int8-gqa"])
    with pytest.raises(SystemExit):
        bench.main(["--library", "a=/no/such.so", "--library", f"b={library}", "--model", model])
    assert "--library a=/no/such.so: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--library", f"a={library}", "--library", f"b={library}", "--model", model,
                    "--prompts", "4000"])
    assert "--prompts: 4000 + 8 decoded tokens exceed the model's max_seq_len" in capsys.readouterr().err
