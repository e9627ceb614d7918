"""Hidden-state prefixes (build_prefix_cache(storage="h8" | "h4"), docs/spec.md §5.4.1, the blob's
version 2, §7; docs/api.md "Hidden-state prefixes"), on every backend:

- an h8 prefix is the kv prefix bit for bit: every generation from it (any depth <= its own,
  suffixes, windows, chunk sizes, sampling, speculative decoding, batches, coda models) gives
  the kv prefix's tokens and logits bits, which are generate(prefix + suffix)'s;
- an h4 prefix gives every backend the numpy reference's tokens and logits bits, differs from
  kv and stays close; its stored rows are a literal §2.2 Q4 + §2.3 steps 2-4 of the layer
  inputs, computed here element by element (and h8's a literal NQ);
- nbytes follows docs/api.md's formula; what cannot be built is refused naming the reason
  (rows as large as the KV, warm start, an odd d_model for h4, bad names); TINYLOOP_KV_H_MODE
  picks the default; `tinyloop demo --prefix-storage` builds its prefix so;
- the blob round-trips (version 2, the same bytes on every backend, each loading the others')
  and a corrupted one raises PrefixFormatError naming the field.

Backends: TINYLOOP_TEST_BACKENDS (conftest.py); the numba-cuda simulator on tiny shapes.
"""
import io
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import strategies as st

import tinyloop
from tinyloop import PrefixFormatError
from tinyloop.cli import main as cli_main

from conftest import assert_same_generation, backend_given, require_backend, simulated
from strategies import engine_settings, model_shapes, prompts, sampling
from test_prefix_blob import patched, with_checksum

HEADER_BYTES = 96
KV_BITS = {"int8": 8, "int4": 4}
STORAGE_CODES = {"h8": 1, "h4": 2}
# multi-head attention, so both h storages fit: rows of d+4 (h8) against 2*4*(16+4) KV bytes
MHA = dict(vocab_size=120, d_model=32, n_heads=4, n_kv_heads=4, head_dim=16, ffn_dim=48,
           n_pre_blocks=1, n_core_blocks=2, n_coda_blocks=1, default_loops=3, max_seq_len=128,
           injection=True, coda_norm=True, qkv_bias=True)
GQA = dict(MHA, d_model=64, n_kv_heads=1, head_dim=8)    # 1 kv head of 8: rows >= KV


def row_bytes(storage, d):
    return d if storage == "h8" else d // 2


def kv_bytes(shape, kv_mode):
    """KV bytes per (slot, position): 2G(R + 4)."""
    return 2 * shape["n_kv_heads"] * (shape["head_dim"] * KV_BITS[kv_mode] // 8 + 4)


def fits(shape, storage, kv_mode):
    """Whether a model of `shape` can build `storage` prefixes: rows smaller than the KV, and
    h8 only with one activation scale per row."""
    return (row_bytes(storage, shape["d_model"]) + 4 < kv_bytes(shape, kv_mode)
            and not (storage == "h8" and shape.get("act_block")))


def h_start(n, window):
    return 0 if window == 0 else max(0, n - window + 1)


def n_layers(shape, loops):
    return shape.get("n_pre_blocks", 0) + loops * (shape.get("n_core_blocks", 1)
                                                  + shape.get("n_coda_blocks", 0))


def h_model(data, zoo, backend, storage=None):
    """(Model on `backend`, its shape, the storage): a drawn shape, engine settings and KV
    mode where the drawn storage (h8 or h4) can be built."""
    storage = storage or data.draw(st.sampled_from(["h8", "h4"]), "storage")
    kv_mode = data.draw(st.sampled_from(["int8", "int4"]), "kv_mode")
    shape = data.draw(model_shapes(tiny=simulated(backend)).filter(
        lambda s: fits(s, storage, kv_mode)), "shape")
    model = zoo.open(shape, backend, kv_mode=kv_mode, **data.draw(engine_settings(), "engine"))
    return model, shape, storage


def h_case(data, zoo, backend, windows):
    """(h_model's Model, the numpy reference on its file, vocab_size, a drawn prompt, drawn
    build_prefix_cache arguments with the storage and a window of `windows`)."""
    model, shape, storage = h_model(data, zoo, backend)
    ref = tinyloop.Model(model.path, backend="numpy", kv_mode=model.kv_mode)
    prompt = data.draw(prompts(shape["vocab_size"]), "prompt")
    made = dict(loops=data.draw(st.integers(1, 3)), storage=storage,
                cache_window=data.draw(st.sampled_from(windows)),
                prefill_chunk=data.draw(st.integers(1, 9)))
    return model, ref, shape["vocab_size"], prompt, made


def build(model, prompt, **kwargs):
    return model.build_prefix_cache(prompt, **kwargs)


# -- h8 is kv, bit for bit --------------------------------------------------------------------

@backend_given(data=st.data())
def test_h8_prefixes_generate_exactly_what_kv_prefixes_and_generate_do(backend, zoo, data):
    model, shape, _ = h_model(data, zoo, backend, "h8")
    with model:
        vocab = shape["vocab_size"]
        prompt = data.draw(prompts(vocab), "prompt")
        loops = data.draw(st.integers(1, 4), "loops")
        window = data.draw(st.sampled_from([0, 0, 1, 3, 8]), "window")
        made = dict(loops=loops, cache_window=window, prefill_chunk=data.draw(st.integers(1, 9)))
        kv, h8 = build(model, prompt, **made), build(model, prompt, storage="h8", **made)
        assert (kv.storage, h8.storage) == ("kv", "h8")
        suffix = data.draw(prompts(vocab, min_size=0, max_size=6), "suffix")
        request = dict(data.draw(sampling()), max_tokens=data.draw(st.integers(1, 6)),
                       loops=data.draw(st.integers(1, loops), "depth"), return_logits=True,
                       prefill_chunk=data.draw(st.integers(1, 9), "chunk"))
        if request["loops"] > 1 and data.draw(st.booleans(), "speculative"):
            request.update(draft_loops=data.draw(st.integers(1, request["loops"] - 1)),
                           n_draft=data.draw(st.integers(1, 4)))
        want = model.generate_from_prefix_cache(kv, suffix=suffix, **request)
        assert_same_generation(model.generate_from_prefix_cache(h8, suffix=suffix, **request),
                               want)
        tokens, logits = model.generate(prompt + suffix, cache_window=window, **request)
        assert_same_generation((tokens, logits), want)
        # a batch from the prefix: each request as on its own
        suffixes = [suffix, data.draw(prompts(vocab, min_size=0, max_size=4), "suffix 2")]
        for got, want in zip(model.generate_batch(suffixes, prefix=h8, **request),
                             model.generate_batch(suffixes, prefix=kv, **request)):
            assert_same_generation(got, want)


# -- h4: exact across backends, an approximation of kv -----------------------------------------

@backend_given(data=st.data())
def test_h_prefixes_give_every_backend_the_references_bits(backend, zoo, data):
    if backend == "numpy":
        pytest.skip("the reference itself")
    model, ref, vocab, prompt, made = h_case(data, zoo, backend, [0, 2, 5])
    with model, ref:
        request = dict(data.draw(sampling()), max_tokens=4, return_logits=True,
                       suffix=data.draw(prompts(vocab, 0, 4)))
        prefix, want = build(model, prompt, **made), build(ref, prompt, **made)
        assert prefix.nbytes == want.nbytes
        assert_same_generation(model.generate_from_prefix_cache(prefix, **request),
                               ref.generate_from_prefix_cache(want, **request))


@pytest.mark.parametrize("storage", ["h8", "h4"])
def test_threads_generating_from_one_h_prefix_each_get_what_one_alone_gets(backend, zoo,
                                                                            storage):
    """Each generation rebuilds the prefix's KV into a cache of its own: four threads at
    once, at two depths, give each thread's serial result."""
    if simulated(backend):
        pytest.skip("the properties run the simulator")
    with zoo.open(MHA, backend) as model:
        prefix = build(model, list(range(3, 40)), loops=3, cache_window=9, storage=storage)
        jobs = [dict(suffix=[5 + i], loops=1 + i % 2, max_tokens=4, return_logits=True)
                for i in range(4)]
        want = [model.generate_from_prefix_cache(prefix, **job) for job in jobs]
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda job: model.generate_from_prefix_cache(prefix, **job),
                                jobs))
        for g, w in zip(got, want, strict=True):
            assert_same_generation(g, w)


def test_h4_differs_from_kv_but_stays_close(zoo):
    with zoo.open(dict(MHA, d_model=64, max_seq_len=256), "numpy") as model:
        prompt = list(np.random.default_rng(5).integers(0, MHA["vocab_size"], 120))
        kv, h4 = build(model, prompt), build(model, prompt, storage="h4")
        request = dict(max_tokens=1, return_logits=True)
        cosines, same_top, differ = [], 0, 0
        for cut in range(0, 40, 4):       # the first logits after each of 10 suffixes
            suffix = prompt[cut:cut + 3]
            _, (want,) = model.generate_from_prefix_cache(kv, suffix=suffix, **request)
            _, (got,) = model.generate_from_prefix_cache(h4, suffix=suffix, **request)
            cosines.append(float(got @ want / np.linalg.norm(got) / np.linalg.norm(want)))
            same_top += int(np.argmax(got) == np.argmax(want))
            differ += not np.array_equal(got.view(np.uint32), want.view(np.uint32))
        assert differ == 10                # an approximation: no suffix gives kv's bits
        assert min(cosines) > 0.9 and same_top >= 7, (cosines, same_top)


# -- the stored rows, computed literally --------------------------------------------------------

def literal_rows(x, storage, eps):
    """One layer input row x (d,) f32 -> (q bytes, a): h8 = NQ(x) (§2.3), h4 = Q4(x) (§2.2)
    then §2.3 steps 2-4, element by element in float32 scalars; h4's q packed low nibble first."""
    f32 = np.float32
    qmax = f32(127 if storage == "h8" else 7)
    amax = f32(0)
    for v in x:
        amax = np.fmax(amax, abs(v))
    if amax < f32(2.0 ** -64):
        q, s = [0] * len(x), f32(0)
    else:
        r = qmax / amax
        q = []
        for v in x:
            y = v * r
            y = y if y >= -qmax else -qmax
            y = y if y <= qmax else qmax
            q.append(int(np.rint(y)))
        s = amax / qmax
    t = f32(sum(v * v for v in q))
    t = t * s
    t = t * s
    t = t / f32(len(x))
    t = t + f32(eps)
    t = np.sqrt(t)
    a = s / t
    if storage == "h8":
        return np.array(q, np.int8).view(np.uint8), a
    return np.array([(q[i] & 0xF) | ((q[i + 1] & 0xF) << 4) for i in range(0, len(q), 2)],
                    np.uint8), a


@pytest.mark.parametrize("storage", ["h8", "h4"])
@pytest.mark.parametrize("window", [0, 5])
def test_stored_rows_are_the_literal_quantization_of_each_layers_input(zoo, storage, window):
    """The rows an h prefix stores, against the inputs the build's layers read (recorded by
    the pass's capture hook) run through the spec's formulas literally."""
    with zoo.open(MHA, "numpy") as model:
        engine = model._engine
        prompt, loops = np.arange(3, 20, dtype=np.int32), 2
        inputs = {}                      # (slot, position) -> the layer input row (d,)

        def record(slot, pos0, x, q, a):
            for i, row in enumerate(np.asarray(x)):
                inputs[slot, pos0 + i] = row.copy()

        cache = engine.new_cache(loops, window)
        engine.prefill(cache, prompt, 4, depth_states=[], capture=record)
        cache.free()
        rows = build(model, list(prompt), loops=loops, cache_window=window, prefill_chunk=6,
                     storage=storage)._state.hidden
        start, n = h_start(len(prompt), window), len(prompt)
        assert rows.start == start and rows.q.shape[:2] == (n_layers(MHA, loops), n - start)
        assert {slot for slot, _ in inputs} == set(range(n_layers(MHA, loops)))
        for (slot, p), x in inputs.items():
            if p < start:
                continue
            q, a = literal_rows(x, storage, model.config()["rms_eps"])
            assert np.array_equal(rows.q[slot, p - start].view(np.uint8), q), (slot, p)
            assert rows.a[slot, p - start].view(np.uint32) == a.view(np.uint32), (slot, p)


# -- nbytes, refusals, the default storage ------------------------------------------------------

@pytest.mark.parametrize("storage", ["h8", "h4"])
@pytest.mark.parametrize("window", [0, 1, 6])
def test_nbytes_counts_the_rows(backend, zoo, storage, window):
    if simulated(backend):
        pytest.skip("the properties run the simulator")
    with zoo.open(MHA, backend) as model:
        prompt, loops, d = list(range(1, 30)), 2, MHA["d_model"]
        prefix = build(model, prompt, loops=loops, cache_window=window, storage=storage)
        rows = n_layers(MHA, loops) * (len(prompt) - h_start(len(prompt), window))
        assert prefix.nbytes == (rows * (row_bytes(storage, d) + 4) + 4 * loops * d
                                 + 4 * len(prompt))


@pytest.mark.parametrize("kv_mode", ["int8", "int4"])
@pytest.mark.parametrize("storage", ["h8", "h4"])
def test_rows_as_large_as_the_kv_are_refused_naming_both_sizes(backend, zoo, storage, kv_mode):
    if simulated(backend):
        pytest.skip("the properties run the simulator")
    with zoo.open(GQA, backend, kv_mode=kv_mode) as model:
        rows, kv = row_bytes(storage, GQA["d_model"]) + 4, kv_bytes(GQA, kv_mode)
        assert rows >= kv
        with pytest.raises(ValueError, match=f"{storage} prefixes take {rows} bytes per layer and "
                                             f"position, the KV {kv} \\(1 kv heads of 8\\): use "
                                             "the kv storage"):
            build(model, [1, 2, 3], storage=storage)


def test_h_prefixes_have_no_warm_start_and_bad_names_are_refused(backend, zoo):
    if simulated(backend):
        pytest.skip("the properties run the simulator")
    with zoo.open(MHA, backend) as model:
        for storage in ("h8", "h4"):
            no_warm_start = (rf"^a hidden-state prefix \({storage}\) has no warm start: drop "
                             "warm_start or use the kv storage$")
            with pytest.raises(ValueError, match=no_warm_start):
                build(model, [1, 2, 3], storage=storage, warm_start=True)
        for bad in ("h2", "KV", "", 8):
            with pytest.raises(ValueError, match=r"storage .* use one of 'kv', 'h8', 'h4'"):
                build(model, [1, 2, 3], storage=bad)
    with pytest.raises(ValueError, match=r"prefix_storage 'fp8' .* use one of 'kv', 'h8', 'h4'"):
        zoo.open(MHA, backend, prefix_storage="fp8")


def test_h4_needs_an_even_d_model(backend, zoo):
    if simulated(backend):
        pytest.skip("the properties run the simulator")
    with zoo.open(dict(MHA, d_model=33), backend) as model:
        with pytest.raises(ValueError, match="h4 prefixes need an even d_model, this model's is "
                                             "33: use h8 or kv"):
            build(model, [1, 2, 3], storage="h4")
        assert build(model, [1, 2, 3], storage="h8").storage == "h8"


@pytest.mark.parametrize("act_block", [1, 16])
def test_h8_needs_one_activation_scale_per_row(backend, zoo, act_block):
    if simulated(backend):
        pytest.skip("the properties run the simulator")
    with zoo.open(dict(MHA, act_block=act_block), backend) as model:
        with pytest.raises(ValueError, match=r"h8 prefixes need one activation scale per row "
                           rf"\(act_block 0\), this model's act_block is {act_block}: use h4 or kv"):
            build(model, [1, 2, 3], storage="h8")
        assert build(model, [1, 2, 3], storage="h4").storage == "h4"


@pytest.mark.parametrize("env, want", [("1", "kv"), ("h8", "h8")])
def test_tinyloop_kv_h_mode_1_keeps_kv_for_block_activations(zoo, monkeypatch, env, want):
    monkeypatch.setenv("TINYLOOP_KV_H_MODE", env)
    with zoo.open(dict(MHA, act_block=16), "numpy") as model:
        assert model.prefix_storage == want


@pytest.mark.parametrize("env, int4, want", [
    (None, False, "kv"), ("", False, "kv"), ("0", True, "kv"), ("1", False, "h8"),
    ("1", True, "h4"), ("h8", True, "h8"), ("h4", False, "h4")])
def test_tinyloop_kv_h_mode_picks_the_default_storage(zoo, monkeypatch, env, int4, want):
    for variable, value in (("TINYLOOP_KV_H_MODE", env),
                            ("TINYLOOP_KV_INT4", "1" if int4 else None)):
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
    with zoo.open(MHA, "numpy") as model:
        assert model.kv_mode == ("int4" if int4 else "int8")
        assert model.prefix_storage == want
        assert build(model, [4, 5, 6]).storage == want
        assert build(model, [4, 5, 6], storage="kv").storage == "kv"
    with zoo.open(MHA, "numpy", prefix_storage="h8") as model:   # the argument wins
        assert model.prefix_storage == "h8"


@pytest.mark.parametrize("value", ["2", "h16", "kv", "yes"])
def test_other_tinyloop_kv_h_mode_values_are_refused(zoo, monkeypatch, value):
    monkeypatch.setenv("TINYLOOP_KV_H_MODE", value)
    with pytest.raises(ValueError, match=f"TINYLOOP_KV_H_MODE='{value}' is not supported; use 0 "
                                         r"\(kv\), 1 .* h8 or h4"):
        zoo.open(MHA, "numpy")


@pytest.mark.parametrize("storage", ["h8", "h4"])
def test_the_demo_builds_its_prefix_with_the_storage_asked_for(storage):
    out = io.StringIO()
    assert cli_main(["demo", "--backend", "numpy", "--max-tokens", "3", "--prefix-storage",
                     storage], out=out) == 0
    text = out.getvalue()
    assert f"{storage} prefix built once" in text
    assert "identical tokens with and without the cache: yes" in text
    assert ("the h4 PrefixCache's tokens equal them" in text) == (storage == "h4")


# -- the blob, version 2 ------------------------------------------------------------------------

@backend_given(data=st.data())
def test_h_blobs_round_trip_and_are_the_same_bytes_on_every_backend(backend, zoo, data):
    model, ref, vocab, prompt, made = h_case(data, zoo, backend, [0, 1, 2, 5])
    with model, ref:
        prefix = build(model, prompt, **made)
        blob = prefix.to_bytes()
        assert blob == build(ref, prompt, **made).to_bytes()
        loaded = model.prefix_from_bytes(blob)
        assert loaded.to_bytes() == blob
        assert (loaded.storage, loaded.nbytes, loaded.loops) == (made["storage"], prefix.nbytes,
                                                                 made["loops"])
        request = dict(data.draw(sampling()), max_tokens=3, return_logits=True,
                       suffix=data.draw(prompts(vocab, 0, 4)))
        want = model.generate_from_prefix_cache(prefix, **request)
        assert_same_generation(model.generate_from_prefix_cache(loaded, **request), want)
        assert_same_generation(ref.generate_from_prefix_cache(ref.prefix_from_bytes(blob),
                                                              **request), want)


def test_h_blob_bytes_follow_the_layout(zoo):
    with zoo.open(MHA, "numpy", kv_mode="int4") as model:
        prompt, d = list(range(3, 23)), MHA["d_model"]
        for storage in ("h8", "h4"):
            blob = build(model, prompt, loops=2, cache_window=6, storage=storage).to_bytes()
            (magic, version, header_bytes, blob_bytes, _, _, _, kv_mode, loops, window, flags,
             n, kv_start, layers, g, hd, d_model, code) = struct.unpack_from(
                "<8sIIQIIQIIIIQQIIIII", blob)
            assert (magic, version, header_bytes, blob_bytes, kv_mode, loops, window, flags, n,
                    kv_start, layers, g, hd, d_model, code) == (
                b"TLPREFIX", 2, 96, len(blob), 1, 2, 6, 0, 20, 20 - 6 + 1, n_layers(MHA, 2),
                4, 16, d, STORAGE_CODES[storage])
            assert blob[92:96] == bytes(4)
            assert np.array_equal(np.frombuffer(blob, "<i4", n, 96), prompt)
            records = layers * (n - kv_start) * (row_bytes(storage, d) + 4)
            assert len(blob) == 96 + 4 * n + 4 * loops * d + records


def corruptions(blob, storage, d):
    """(name, corrupted blob, the field its error names) of an h blob: header fields and
    record values edited with the checksum recomputed, so each reaches its own rule."""
    n, kv_start = struct.unpack_from("<QQ", blob, 56)
    loops = struct.unpack_from("<I", blob, 44)[0]
    records = HEADER_BYTES + 4 * n + 4 * loops * d    # slot 0, position kv_start: q then a
    bad_q = 0x80 if storage == "h8" else 0x08
    return [
        ("version", patched(blob, 8, "<I", 3), "version"),
        ("storage 0", patched(blob, 88, "<I", 0), "storage"),
        ("storage 3", patched(blob, 88, "<I", 3), "storage"),
        ("flags", patched(blob, 52, "<I", 1), "flags"),
        ("kv_start", patched(blob, 64, "<Q", kv_start - 1), "kv_start"),
        ("instruction", patched(blob, 92, "<I", n + 1), "instruction"),
        ("q", patched(blob, records + 1, "<B", bad_q),
         f"hidden: slot 0, position {kv_start}: .*row"),
        ("a", patched(blob, records + row_bytes(storage, d), "<f", -1.0),
         f"hidden: slot 0, position {kv_start}: .*scale"),
        ("truncated", with_checksum(blob[:-1]), "blob_bytes"),
        ("checksum", blob[:-1] + bytes([blob[-1] ^ 1]), "checksum"),
    ]


@pytest.mark.parametrize("storage", ["h8", "h4"])
def test_a_corrupted_h_blob_raises_naming_the_field(numpy_or_native, zoo, storage):
    with zoo.open(MHA, numpy_or_native) as model, zoo.open(MHA, "numpy") as ref:
        blob = build(ref, list(range(2, 25)), loops=2, cache_window=9, storage=storage).to_bytes()
        assert model.prefix_from_bytes(blob).to_bytes() == blob
        for name, bad, field in corruptions(blob, storage, MHA["d_model"]):
            with pytest.raises(PrefixFormatError, match=field):
                model.prefix_from_bytes(bad)
        # a version-1 (kv) blob whose storage field says h: a kv prefix stores 0 there
        kv = build(ref, list(range(2, 25)), loops=2).to_bytes()
        with pytest.raises(PrefixFormatError, match="storage"):
            model.prefix_from_bytes(patched(kv, 88, "<I", STORAGE_CODES[storage]))


def test_an_h_prefix_of_a_native_build_is_the_references(zoo):
    """libtinyloop's rows (tl_prefix_build_ex with TL_PREFIX_STORE_H8 / _H4) against numpy's:
    the blobs equal, so the rows are the same bits."""
    require_backend("native")
    with zoo.open(MHA, "native", kv_mode="int4") as model, \
            zoo.open(MHA, "numpy", kv_mode="int4") as ref:
        prompt = list(range(5, 40))
        for storage in ("h8", "h4"):
            made = dict(loops=3, cache_window=11, prefill_chunk=4, storage=storage)
            assert build(model, prompt, **made).to_bytes() == build(ref, prompt, **made).to_bytes()
