"""Every documented error, on every backend: the seed's error table and DESIGN §5, each with
its type and a message naming the problem; the model keeps working afterwards. Errors raised by
Model itself before any engine exists (bad backend, kv_mode or budget) need no backend."""
import math

import numpy as np
import pytest

import tinyloop
from tinyloop.quickbench import backend_kwargs

GOOD = [1, 2, 3]


def prefix_of(model, **kw):
    return model.build_prefix_cache(GOOD, **kw)


CASES = [
    # (id, call(model), error type, message fragment)
    ("loops<1", lambda m: m.generate(GOOD, loops=0), ValueError, "loops < 1"),
    ("loops negative", lambda m: m.build_prefix_cache(GOOD, loops=-2), ValueError, "loops < 1"),
    ("loops float", lambda m: m.generate(GOOD, loops=2.0), ValueError, "loops must be an integer"),
    ("cache_window<0", lambda m: m.generate(GOOD, cache_window=-1), ValueError, "cache_window < 0"),
    ("prefix cache_window<0", lambda m: m.build_prefix_cache(GOOD, cache_window=-1), ValueError,
     "cache_window < 0"),
    ("max_tokens<1", lambda m: m.generate(GOOD, max_tokens=0), ValueError, "max_tokens < 1"),
    ("prefix max_tokens<1", lambda m: m.generate_from_prefix_cache(prefix_of(m), max_tokens=0),
     ValueError, "max_tokens < 1"),
    ("max_tokens bool", lambda m: m.generate(GOOD, max_tokens=True), ValueError, "max_tokens"),
    ("empty prompt", lambda m: m.generate([]), ValueError, "prompt is empty"),
    ("2-D prompt", lambda m: m.generate([[1, 2], [3, 4]]), ValueError, "1-D"),
    ("float prompt", lambda m: m.generate([1.0, 2.0]), ValueError, "integer"),
    ("string prompt", lambda m: m.generate("hello"), ValueError, "token ids"),
    ("float array prompt", lambda m: m.generate(np.ones(3)), ValueError, "dtype float64"),
    ("id too large", lambda m: m.generate([1, 263]), ValueError, "token id 263 at index 1"),
    ("negative id", lambda m: m.generate([-1, 2]), ValueError, "token id -1 at index 0"),
    ("huge id", lambda m: m.generate([2**40]), ValueError, "out of range"),
    ("NaN temperature", lambda m: m.generate(GOOD, temperature=math.nan), ValueError, "temperature"),
    ("inf temperature", lambda m: m.generate(GOOD, temperature=math.inf), ValueError, "temperature"),
    ("negative temperature", lambda m: m.generate(GOOD, temperature=-0.5), ValueError, "temperature"),
    ("top_p 0", lambda m: m.generate(GOOD, top_p=0.0), ValueError, "top_p"),
    ("top_p > 1", lambda m: m.generate(GOOD, top_p=1.5), ValueError, "top_p"),
    ("top_p NaN", lambda m: m.generate(GOOD, top_p=math.nan), ValueError, "top_p"),
    ("top_k negative", lambda m: m.generate(GOOD, top_k=-1), ValueError, "top_k < 0"),
    ("penalty 0", lambda m: m.generate(GOOD, repetition_penalty=0.0), ValueError, "repetition_penalty"),
    ("penalty inf", lambda m: m.generate(GOOD, repetition_penalty=math.inf), ValueError,
     "repetition_penalty"),
    ("seed negative", lambda m: m.generate(GOOD, seed=-1), ValueError, "seed"),
    ("seed too big", lambda m: m.generate(GOOD, seed=2**64), ValueError, "seed"),
    ("stop flat list", lambda m: m.generate(GOOD, stop_sequences=[1, 2]), ValueError, "stop_sequences"),
    ("stop empty seq", lambda m: m.generate(GOOD, stop_sequences=[[]]), ValueError, "stop_sequences[0]"),
    ("stop bad id", lambda m: m.generate(GOOD, stop_sequences=[[999]]), ValueError, "out of range"),
    ("prefill_chunk 0", lambda m: m.generate(GOOD, prefill_chunk=0), ValueError, "prefill_chunk < 1"),
    ("huge max_tokens", lambda m: m.generate(GOOD, max_tokens=10**9), RuntimeError, "max_seq_len"),
    ("prompt > max_seq_len", lambda m: m.generate([1] * 97), RuntimeError, "max_seq_len"),
    ("prefix > max_seq_len", lambda m: m.build_prefix_cache([1] * 97), RuntimeError, "max_seq_len"),
    ("prefix + tokens > max_seq_len",
     lambda m: m.generate_from_prefix_cache(m.build_prefix_cache([1] * 90), max_tokens=7),
     RuntimeError, "max_seq_len"),
    ("loops mismatch", lambda m: m.generate_from_prefix_cache(prefix_of(m, loops=2), loops=3),
     RuntimeError, "loops mismatch"),
    ("window mismatch",
     lambda m: m.generate_from_prefix_cache(prefix_of(m, cache_window=4), cache_window=8),
     RuntimeError, "cache_window mismatch"),
    ("not a prefix", lambda m: m.generate_from_prefix_cache(GOOD), ValueError, "PrefixCache"),
    ("bad suffix id", lambda m: m.generate_from_prefix_cache(prefix_of(m), suffix=[1000]),
     ValueError, "suffix: token id 1000"),
    ("logits bad loops", lambda m: m.logits(GOOD, loops=0), ValueError, "loops < 1"),
]


@pytest.mark.parametrize("call, error, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_documented_error(on_backend, call, error, fragment):
    model = on_backend["int8-gqa"]
    before = model.generate([4, 5, 6], max_tokens=4)
    with pytest.raises(error) as info:
        call(model)
    assert type(info.value) is error
    assert fragment in str(info.value)
    assert model.generate([4, 5, 6], max_tokens=4) == before


def test_prefix_from_another_model_is_refused(on_backend, models):
    """A prefix of another file on this backend, or of the same file on the numpy backend."""
    for other in (on_backend["int8-gqa"], models["int4-mha"]):
        prefix = other.build_prefix_cache(GOOD)
        with pytest.raises(ValueError, match="another model"):
            on_backend["int4-mha"].generate_from_prefix_cache(prefix)


def test_closed_model_raises_runtime_error_everywhere(model_files, backend):
    model = tinyloop.Model(model_files["int8-gqa"], **backend_kwargs(backend))
    prefix = model.build_prefix_cache(GOOD)
    model.close()
    model.close()  # idempotent
    for call in (lambda: model.generate(GOOD), lambda: model.build_prefix_cache(GOOD),
                 lambda: model.generate_from_prefix_cache(prefix), lambda: model.config(),
                 lambda: model.logits(GOOD)):
        with pytest.raises(RuntimeError, match="model was closed"):
            call()
    assert list(prefix.prompt) == GOOD  # the prefix object itself stays inspectable


def test_context_manager_closes(model_files):
    with tinyloop.Model(model_files["int8-gqa"], backend="numpy") as model:
        assert model.generate(GOOD, max_tokens=2)[:3] == GOOD
    assert model.closed


def test_kv_mode_argument(model_files):
    with pytest.raises(ValueError, match="kv_mode"):
        tinyloop.Model(model_files["int8-gqa"], kv_mode="fp16")
    tinyloop.Model(model_files["int8-gqa"], kv_mode="int8").close()


def test_unknown_backend_is_refused(model_files, monkeypatch):
    with pytest.raises(ValueError, match="backend 'cuda-magic'"):
        tinyloop.Model(model_files["int8-gqa"], backend="cuda-magic")
    monkeypatch.setenv("TINYLOOP_BACKEND", "bogus")
    with pytest.raises(ValueError, match="TINYLOOP_BACKEND"):
        tinyloop.Model(model_files["int8-gqa"])


def test_bad_file_raises_model_format_error(tmp_path, backend):
    path = tmp_path / "bad.tinyloop"
    path.write_bytes(b"NOTALOOP" + bytes(300))
    with pytest.raises(tinyloop.ModelFormatError, match="magic"):
        tinyloop.Model(path, **backend_kwargs(backend))
    with pytest.raises(FileNotFoundError):
        tinyloop.Model(tmp_path / "missing.tinyloop", **backend_kwargs(backend))


def test_prefix_cache_copies_the_prompt(on_backend):
    model = on_backend["int8-gqa"]
    prompt = np.array([3, 4, 5], np.int32)
    prefix = model.build_prefix_cache(prompt)
    prompt[0] = 99
    assert list(prefix.prompt) == [3, 4, 5]
    with pytest.raises(ValueError):
        prefix.prompt[0] = 1
    assert prefix.loops == model.config()["default_loops"]
    assert prefix.cache_window == 0 and prefix.nbytes > 0


def test_allocation_failure_is_runtime_error_out_of_memory(model_files, backend, monkeypatch):
    """A MemoryError out of the engine (numpy's, or cffi's for native) is the documented
    RuntimeError("... out of memory")."""
    model = tinyloop.Model(model_files["int8-gqa"], **backend_kwargs(backend))
    before = model.generate(GOOD, max_tokens=3)
    engine_class = type(model._engine)

    def no_memory(*args, **kwargs):
        raise MemoryError

    for method in ("generate", "build_prefix", "logits"):
        with monkeypatch.context() as patch:
            patch.setattr(engine_class, method, no_memory)
            with pytest.raises(RuntimeError, match="out of memory"):
                {"generate": lambda: model.generate(GOOD),
                 "build_prefix": lambda: model.build_prefix_cache(GOOD),
                 "logits": lambda: model.logits(GOOD)}[method]()
    assert model.generate(GOOD, max_tokens=3) == before
    model.close()
