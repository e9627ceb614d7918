"""The cffi binding of libtinyloop: complete, ABI-checked, with safe handle lifetimes.

Skips when the native backend is not available (declared feature "native"); with
TINYLOOP_REQUIRE_NATIVE=1 (as in .ci/run) a missing library fails instead.
"""
import os
import re
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import tinyloop
from tinyloop import _library

pytestmark = pytest.mark.usefixtures("require_native")


def header_functions():
    text = _library.header_path(tinyloop.backend_info("native")["library"]).read_text()
    return set(re.findall(r"TL_API\s+[\w\s\*]+?\b(tl_\w+)\s*\(", text))


def test_every_header_function_is_bound_and_exported():
    ffi, lib, path, _ = _library.load_library()
    declared = header_functions()
    assert len(declared) >= 25
    for name in declared:
        assert callable(getattr(lib, name)), name
    exported = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True,
                              text=True, check=True).stdout
    exported = set(re.findall(r"\bT (tl_\w+)", exported))
    assert exported == declared


def test_header_library_and_package_agree_on_the_abi_version():
    _, lib, _, _ = _library.load_library()
    assert lib.TL_ABI_VERSION == lib.tl_abi_version() == _library.ABI_VERSION


def test_abi_mismatch_is_an_import_error_naming_both_versions(monkeypatch):
    found = _library.ABI_VERSION
    monkeypatch.setattr(_library, "ABI_VERSION", 999)
    with pytest.raises(ImportError, match=f"ABI version {found}; this tinyloop package needs 999"):
        _library.load_library()


def test_cdef_is_derived_from_the_header_without_edits():
    text = _library.header_path(tinyloop.backend_info("native")["library"]).read_text()
    cdef = _library.cdef_from_header(text)
    assert "TL_API" not in cdef and "#" not in cdef and 'extern "C"' not in cdef
    for name in header_functions():
        assert name in cdef


def test_closing_a_model_fails_later_calls_cleanly(model_files):
    model = tinyloop.Model(model_files["int8-gqa"], backend="native")
    prefix = model.build_prefix_cache([1, 2, 3])
    engine, state = model._engine, prefix._state
    model.close()
    model.close()
    with pytest.raises(RuntimeError, match="model was closed"):
        model.generate_from_prefix_cache(prefix)
    # the C side refuses too, even when reached directly
    params = tinyloop.params.generation_params(
        engine.config, max_tokens=2, loops=None, temperature=0.0, top_k=0, top_p=1.0,
        cache_window=0, repetition_penalty=1.0, stop_sequences=(), seed=0, prefill_chunk=None,
        default_chunk=8)
    with pytest.raises(RuntimeError, match="model was closed"):
        engine.generate_from_prefix(state, np.zeros(0, np.int32), params)


def test_prefix_outlives_a_dropped_model_reference(model_files):
    model = tinyloop.Model(model_files["int8-gqa"], backend="native")
    expected = model.generate([4, 5, 6], max_tokens=5)
    prefix = model.build_prefix_cache([4, 5, 6])
    del model
    import gc
    gc.collect()
    assert prefix._model.generate_from_prefix_cache(prefix, max_tokens=5) == expected


def test_interpreter_shutdown_with_live_objects_is_silent(model_files, tmp_path):
    script = textwrap.dedent(f"""
        import tinyloop
        model = tinyloop.Model({str(model_files['int8-gqa'])!r}, backend="native")
        prefix = model.build_prefix_cache([1, 2, 3, 4])
        other = tinyloop.Model({str(model_files['int4-mha'])!r}, backend="native")
        cycle = [model, prefix, other]
        cycle.append(cycle)
        print(len(model.generate_from_prefix_cache(prefix, max_tokens=3)))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # not the source tree: it shadows the package
    assert done.returncode == 0 and done.stdout.strip() == "7"
    assert done.stderr == ""


def open_with_isa(path, value, cwd):
    """The finished `python -c` that opens `path` natively with TINYLOOP_ISA=value (None:
    unset) and prints its runtime ISA."""
    script = ("import tinyloop; "
              f"print(tinyloop.Model({str(path)!r}, backend='native').runtime()['isa'])")
    env = {name: text for name, text in os.environ.items() if name != "TINYLOOP_ISA"}
    if value is not None:
        env["TINYLOOP_ISA"] = value
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


@pytest.mark.parametrize("value, isa", [("scalar", "scalar"), ("avx2", "avx2"),
                                        ("avx512", "avx512-vnni"),
                                        ("avx512-vnni", "avx512-vnni"), ("amx", "amx")])
def test_tinyloop_isa_forces_the_kernel_path(model_files, tmp_path, value, isa):
    done = open_with_isa(model_files["int8-gqa"], value, tmp_path)
    if isa in tinyloop.backends.native_isas():
        assert done.returncode == 0 and done.stdout == f"{isa}\n", done.stderr
    else:
        assert done.returncode != 0 and done.stderr.splitlines()[-1] == (
            f"RuntimeError: isa {isa} is not supported by this CPU or build (from TINYLOOP_ISA)")


def test_an_unknown_tinyloop_isa_fails_the_open_naming_it(model_files, tmp_path):
    done = open_with_isa(model_files["int8-gqa"], "bogus", tmp_path)
    assert done.returncode != 0 and done.stderr.splitlines()[-1] == (
        "ValueError: TINYLOOP_ISA must be auto, scalar, avx2, avx512, avx512-vnni or amx, "
        "got 'bogus'")


def test_an_empty_or_auto_tinyloop_isa_is_the_default_path(model_files, tmp_path):
    done = [open_with_isa(model_files["int8-gqa"], value, tmp_path) for value in (None, "", "auto")]
    assert [d.returncode for d in done] == [0, 0, 0], [d.stderr for d in done]
    assert done[0].stdout == done[1].stdout == done[2].stdout
    assert done[0].stdout.strip() in tinyloop.backends.native_isas()


@pytest.mark.parametrize("isa", tinyloop.backends.native_isas())
@pytest.mark.parametrize("name", ["int8-gqa", "int4-mha", "int4-v2-sandwich"])
def test_the_avx2_row_kernels_give_the_widest_ones_bits(model_files, monkeypatch, isa, name):
    """TINYLOOP_ROW_KERNELS=avx2 (the benches' "before" of the AVX-512 row and attention
    kernels) and the default give the same logits on every path, prefill chunks (AMX tiles)
    and single rows alike, and the same sampled tokens."""
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 100, 70)]
    runs = []
    for rows in ("auto", "avx2"):
        monkeypatch.setenv("TINYLOOP_ISA", isa)
        monkeypatch.setenv("TINYLOOP_ROW_KERNELS", rows)
        with tinyloop.Model(model_files[name], backend="native", threads=2,
                            prefix_cache_bytes=0) as model:
            assert model.runtime()["isa"] == isa
            runs.append((model.logits(prompt, prefill_chunk=40), model.logits(prompt, prefill_chunk=1),
                         model.generate(prompt, max_tokens=12, temperature=0.8, seed=5)))
    (chunked, rows, tokens), (chunked2, rows2, tokens2) = runs
    assert chunked.tobytes() == chunked2.tobytes() == rows.tobytes() == rows2.tobytes()
    assert tokens == tokens2


def test_an_unknown_tinyloop_row_kernels_fails_the_open_naming_it(model_files, monkeypatch):
    monkeypatch.setenv("TINYLOOP_ROW_KERNELS", "avx1024")
    with pytest.raises(ValueError, match=r"^TINYLOOP_ROW_KERNELS must be auto or avx2, got 'avx1024'$"):
        tinyloop.Model(model_files["int8-gqa"], backend="native")


def test_threads_sharing_one_prefix_get_what_sequential_calls_get(models_by_backend):
    model = models_by_backend("native")["int8-gqa"]
    prefix = model.build_prefix_cache(list(range(1, 40)))
    kwargs = [dict(max_tokens=12, temperature=0.9, seed=s) for s in range(8)]
    sequential = [model.generate_from_prefix_cache(prefix, **kw) for kw in kwargs]
    results = [None] * 8

    def work(i):
        results[i] = model.generate_from_prefix_cache(prefix, **kwargs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == sequential


def test_backend_info_names_the_library(models_by_backend):
    info = tinyloop.backend_info("native")
    assert info["available"] and info["library"].endswith(".so")
    assert info["origin"] in ("TINYLOOP_LIBRARY", "package", "checkout build", "installed package")
    assert "native" in tinyloop.backend_features


def test_exit_rules_and_depth_counts_reach_the_library(model_files):
    """The native engine hands GenerationParams' exit rule to libtinyloop (docs/spec.md §5.7) on
    every path, and on_depth the totals once: with a threshold no state change stays under, the
    latent rule exits every decoded token at min_loops; the tokens are the same alone, in a
    batch beside a plain request, from a prefix and scheduled, whose counters count the decode
    passes and their loops. The gate on a model without one is refused with the library's words."""
    from dataclasses import replace

    from tinyloop import backends
    from tinyloop.engine import NO_CALLBACKS, Callbacks, GenerationParams

    engine = backends.open_engine("native", model_files["int8-gqa"], block_size=4, threads=2)
    prompt = np.arange(1, 12, dtype=np.int32)
    plain = GenerationParams(max_tokens=7, loops=3, cache_window=0, temperature=0.0, top_k=0,
                             top_p=1.0, repetition_penalty=1.0, stop_sequences=(), seed=3,
                             prefill_chunk=4)
    adaptive = replace(plain, exit_rule="latent", exit_threshold=1e30, min_loops=2)
    depths = []
    on_depth = Callbacks(on_depth=lambda tokens, loops: depths.append((tokens, loops)))
    tokens, _ = engine.generate(prompt, adaptive, callbacks=on_depth)
    assert len(tokens) == 7 and depths == [(6, 12)]
    assert engine.generate(prompt, replace(adaptive, min_loops=3)) == engine.generate(prompt, plain)

    batch = engine.generate_batch([(None, prompt, adaptive, on_depth), (None, prompt, plain, NO_CALLBACKS)])
    assert batch == [(tokens, None), engine.generate(prompt, plain)] and depths[-1] == (6, 12)
    prefix = engine.build_prefix(prompt[:5], 3, 0, 0)
    assert engine.generate_from_prefix(prefix, prompt[5:], adaptive)[0] == tokens
    prefix.free()

    scheduler = engine.new_scheduler(2, 8, 0)
    request_id = scheduler.add(prompt, adaptive)
    emitted = []
    while len(emitted) < 7:
        emitted += [token for rid, token, _ in scheduler.step() if rid == request_id]
    stats = scheduler.stats()
    assert emitted == tokens and (stats["decode_passes"], stats["decode_loops"]) == (6, 12)
    scheduler.free()

    with pytest.raises(ValueError, match="exit_rule gate: the model has no exit gate"):
        engine.generate(prompt, replace(adaptive, exit_rule="gate", exit_threshold=0.5))
    engine.close()
