"""Prefixes as bytes (PrefixCache.to_bytes, Model.prefix_from_bytes; docs/spec.md §7), on every
backend: a loaded prefix is the prefix it was saved from (every generation from it the same
tokens and bit-identical logits, its blob the same bytes), whatever block size loads it; two
backends saving the same prefix write the same bytes and load each other's; a warm-start
prefix round-trips and extends like the original. A blob of another model or KV mode, or a
corrupted one (every truncation, byte flips, field edits with the checksum recomputed so the
deeper rules are reached), raises PrefixFormatError naming the field, on the Python loader
and, through the same API, libtinyloop's.
"""
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tinyloop
from tinyloop import PrefixFormatError

from conftest import assert_same_generation, backend_given, require_backend, simulated
from strategies import engine_settings, model_shapes, prompts, sampling

CHECKSUM_AT = 24
HEADER_BYTES = 96


def with_checksum(blob):
    """`blob` with its checksum field recomputed (CRC-32 with the field read as zero)."""
    blob = bytearray(blob)
    blob[CHECKSUM_AT:CHECKSUM_AT + 4] = bytes(4)
    struct.pack_into("<I", blob, CHECKSUM_AT, zlib.crc32(blob))
    return bytes(blob)


def patched(blob, offset, fmt, value):
    """`blob` with `value` packed at `offset`, its checksum recomputed."""
    blob = bytearray(blob)
    struct.pack_into(fmt, blob, offset, value)
    return with_checksum(blob)


def drawn_model(data, zoo, backend):
    """A Model on `backend` of a drawn shape (tiny on the simulator), thread count, KV block
    size and KV mode."""
    return zoo.open(data.draw(model_shapes(tiny=simulated(backend)), "shape"), backend,
                    **data.draw(engine_settings(), "engine"),
                    kv_mode=data.draw(st.sampled_from(["int8", "int4"]), "kv_mode"))


def reference(model, **kwargs):
    """The numpy Model of the same file and KV mode (kwargs: Model's)."""
    return tinyloop.Model(model.path, backend="numpy", kv_mode=model.kv_mode, **kwargs)


@backend_given(data=st.data())
def test_a_loaded_prefix_is_the_prefix_it_was_saved_from(backend, zoo, data):
    with drawn_model(data, zoo, backend) as model:
        vocab = model.config()["vocab_size"]
        prompt = data.draw(prompts(vocab), "prompt")
        loops = data.draw(st.integers(1, 4), "loops")
        window = data.draw(st.sampled_from([0, 0, 1, 3, 8]), "window")
        warm = data.draw(st.booleans(), "warm_start")
        prefix = model.build_prefix_cache(prompt, loops=loops, cache_window=window,
                                          prefill_chunk=data.draw(st.integers(1, 9)),
                                          warm_start=warm)
        blob = prefix.to_bytes()
        loaded = model.prefix_from_bytes(blob)
        assert loaded.to_bytes() == blob
        assert (list(loaded.prompt), loaded.loops, loaded.cache_window, loaded.warm_start,
                loaded.nbytes) == (prompt, loops, window, warm, prefix.nbytes)
        request = dict(data.draw(sampling()), max_tokens=data.draw(st.integers(1, 6)),
                       loops=data.draw(st.integers(1, loops), "generation depth"),
                       suffix=data.draw(prompts(vocab, min_size=0, max_size=5), "suffix"),
                       return_logits=True)
        want = model.generate_from_prefix_cache(prefix, **request)
        assert_same_generation(model.generate_from_prefix_cache(loaded, **request), want)
        # another block size pages it differently, and generates the same
        block_size = data.draw(engine_settings(), "other engine")["block_size"]
        with reference(model, block_size=block_size) as other:
            assert_same_generation(other.generate_from_prefix_cache(
                other.prefix_from_bytes(blob), **request), want)
        if warm:
            deeper = loops + data.draw(st.integers(1, 2), "extended by")
            prefix.extend(deeper)
            loaded.extend(deeper)
            assert loaded.to_bytes() == prefix.to_bytes()
            request["loops"] = deeper
            assert_same_generation(model.generate_from_prefix_cache(loaded, **request),
                                   model.generate_from_prefix_cache(prefix, **request))


@backend_given(data=st.data())
def test_backends_write_the_same_blob_and_load_each_others(backend, zoo, data):
    if backend == "numpy":
        pytest.skip("the reference itself")
    with drawn_model(data, zoo, backend) as model, \
            reference(model, block_size=model.runtime()["kv_block_size"]) as ref:
        prompt = data.draw(prompts(model.config()["vocab_size"]), "prompt")
        build = dict(loops=data.draw(st.integers(1, 3)),
                     cache_window=data.draw(st.sampled_from([0, 2, 5])),
                     warm_start=data.draw(st.booleans()))
        blob = model.build_prefix_cache(prompt, **build).to_bytes()
        assert ref.build_prefix_cache(prompt, **build).to_bytes() == blob
        request = dict(data.draw(sampling()), max_tokens=4, return_logits=True,
                       suffix=data.draw(prompts(model.config()["vocab_size"], 0, 4)))
        assert_same_generation(model.generate_from_prefix_cache(model.prefix_from_bytes(blob),
                                                                **request),
                               ref.generate_from_prefix_cache(ref.prefix_from_bytes(blob),
                                                              **request))
        assert ref.prefix_from_bytes(blob).to_bytes() == blob


def test_blob_bytes_follow_the_layout(models):
    """The header's fields and the blob's size as docs/spec.md §7 lays them out."""
    model = models["int8-v2-coda"]          # a coda and injection: states and injects stored
    c = model.config()
    prompt = list(range(3, 23))
    prefix = model.build_prefix_cache(prompt, loops=2, cache_window=6, warm_start=True)
    blob = prefix.to_bytes()
    (magic, version, header_bytes, blob_bytes, _, _, _, kv_mode, loops, window, flags, n,
     kv_start, n_layers, g, d, d_model) = struct.unpack_from("<8sIIQIIQIIIIQQIIII", blob)
    assert (magic, version, header_bytes, blob_bytes, kv_mode, loops, window, flags, n) == (
        b"TLPREFIX", 1, 96, len(blob), 0, 2, 6, 3, len(prompt))
    assert (g, d, d_model) == (c["n_kv_heads"], c["head_dim"], c["d_model"])
    assert n_layers == c["n_pre_blocks"] + 2 * (c["n_core_blocks"] + c["n_coda_blocks"])
    assert kv_start == (len(prompt) - 6 + 1) // 16 * 16       # the first block kept (of 16)
    assert blob[88:96] == bytes(8)
    assert np.array_equal(np.frombuffer(blob, "<i4", n, 96), prompt)
    records = n_layers * (n - kv_start) * g * (2 * d + 8)
    assert len(blob) == 96 + 4 * n + 4 * loops * d_model + records + 2 * 4 * n * d_model


@pytest.mark.parametrize("loader", ["numpy", "native"])
def test_a_warm_start_blob_without_states_extends_by_rebuilding(models, loader):
    """The blob of a backend without a resuming pass (spec §7.3) keeps no states: it loads as a
    warm-start prefix, saves the same bytes, and a deeper request rebuilds it."""
    if loader == "native":
        require_backend("native")
    model = models["int8-v2-coda"]
    c, prompt = model.config(), list(range(2, 30))
    blob = model.build_prefix_cache(prompt, loops=1, cache_window=9, warm_start=True).to_bytes()
    states_bytes = 2 * 4 * len(prompt) * c["d_model"]         # states and injects
    stateless = bytearray(blob[:-states_bytes])
    struct.pack_into("<Q", stateless, 16, len(stateless))
    struct.pack_into("<I", stateless, 52, 1)                   # warm start, no states
    stateless = with_checksum(stateless)
    with tinyloop.Model(model.path, backend=loader) as opened:
        loaded = opened.prefix_from_bytes(stateless)
        assert loaded.warm_start and loaded.to_bytes() == stateless
        request = dict(loops=3, max_tokens=5, suffix=[4, 5], return_logits=True)
        want = model.generate_from_prefix_cache(
            model.build_prefix_cache(prompt, loops=3, cache_window=9), **request)
        assert_same_generation(opened.generate_from_prefix_cache(loaded, **request), want)
        assert loaded.loops == 3


# ---- what a loader refuses ---------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(models):
    """(model, blob) of a warm-start prefix with a window on a coda + injection model."""
    model = models["int8-v2-coda"]
    prefix = model.build_prefix_cache(list(range(5, 45)), loops=2, cache_window=7,
                                      warm_start=True)
    return model, prefix.to_bytes()


def _fields(model, blob):
    """(what the error names, the blob with one rule broken and the checksum recomputed) for
    each rule of §7 past the checksum, in check order."""
    c = model.config()
    model_checksum, model_file_bytes = struct.unpack_from("<IQ", blob, 28)
    n = struct.unpack_from("<Q", blob, 56)[0]
    kv_start = struct.unpack_from("<Q", blob, 64)[0]
    kv_at = 96 + 4 * n + 4 * 2 * c["d_model"]
    r = c["head_dim"]
    return [
        (r"another model \(checksum", patched(blob, 28, "<I", model_checksum ^ 1)),
        (r"another model \(file_bytes", patched(blob, 32, "<Q", model_file_bytes + 64)),
        ("saved with kv_mode int4; this model runs int8", patched(blob, 40, "<I", 1)),
        ("n_kv_heads", patched(blob, 76, "<I", c["n_kv_heads"] + 1)),
        ("head_dim", patched(blob, 80, "<I", c["head_dim"] + 2)),
        ("d_model", patched(blob, 84, "<I", c["d_model"] + 8)),
        ("loops", patched(blob, 44, "<I", 0)),
        ("loops", patched(blob, 44, "<I", 2**32 - 1)),
        ("n_layers", patched(blob, 72, "<I", struct.unpack_from("<I", blob, 72)[0] + 1)),
        ("flags", patched(blob, 52, "<I", 3 | 8)),
        ("flags", patched(blob, 52, "<I", 2)),
        ("n_tokens", patched(blob, 56, "<Q", 0)),
        ("n_tokens", patched(blob, 56, "<Q", c["max_seq_len"] + 1)),
        ("kv_start", patched(patched(blob, 48, "<I", 0), 64, "<Q", kv_start)),
        ("kv_start", patched(blob, 64, "<Q", n)),
        ("instruction", patched(blob, 92, "<I", n + 1)),
        ("storage", patched(blob, 90, "<B", 1)),
        ("blob_bytes", with_checksum(blob[:16] + struct.pack("<Q", len(blob) + 4) + blob[24:]
                                     + bytes(4))),
        ("tokens", patched(blob, 96 + 4 * 3, "<i", c["vocab_size"])),
        ("tokens", patched(blob, 96, "<i", -1)),
        ("kv", patched(blob, kv_at + 1, "<b", -128)),                # a key byte of -128
        ("kv", patched(blob, kv_at + r + 2, "<b", -128)),            # a value byte
        ("kv", patched(blob, kv_at + 2 * r, "<f", -1.0)),            # the key scale
        ("kv", patched(blob, kv_at + 2 * r + 4, "<f", float("nan"))),  # the value scale
    ]


@pytest.mark.parametrize("loader", ["numpy", "native"])
def test_each_broken_rule_is_named(saved, loader):
    model, blob = saved
    if loader == "native":
        require_backend("native")
    with tinyloop.Model(model.path, backend=loader) as opened:
        opened.prefix_from_bytes(blob)                  # the untouched blob loads
        for field, broken in _fields(model, blob):
            with pytest.raises(PrefixFormatError, match=field):
                opened.prefix_from_bytes(broken)
        for name, broken in (("magic", b"TLPREFIY" + blob[8:]),
                             ("version", blob[:8] + struct.pack("<I", 3) + blob[12:]),
                             ("header_bytes", blob[:12] + struct.pack("<I", 97) + blob[16:]),
                             ("checksum", blob[:CHECKSUM_AT] + b"\0\0\0\0" + blob[28:])):
            with pytest.raises(PrefixFormatError, match=name):
                opened.prefix_from_bytes(broken)


@pytest.mark.parametrize("loader", ["numpy", "native"])
def test_the_first_broken_record_is_named_whatever_rule_it_breaks(saved, loader):
    """Records are checked in blob order, each one's kq, vq, then its scales (§7.4): a bad
    scale in one record is named before a bad key row in a later one, on every loader."""
    model, blob = saved
    if loader == "native":
        require_backend("native")
    c = model.config()
    n, kv_start = struct.unpack_from("<Q", blob, 56)[0], struct.unpack_from("<Q", blob, 64)[0]
    r, g = c["head_dim"], c["n_kv_heads"]
    record = 2 * r + 8
    kv_at = 96 + 4 * n + 4 * 2 * c["d_model"]
    first, later = 0, g + 1                  # position kv_start, head 0; the next position
    broken = patched(patched(blob, kv_at + first * record + 2 * r + 4, "<f", -1.0),
                     kv_at + later * record, "<b", -128)
    with tinyloop.Model(model.path, backend=loader) as opened:
        with pytest.raises(PrefixFormatError,
                           match=f"slot 0, position {kv_start}, kv head 0: .*value scale"):
            opened.prefix_from_bytes(broken)


def test_every_truncation_is_refused(saved):
    model, blob = saved
    for size in range(len(blob)):
        with pytest.raises(PrefixFormatError, match="too small" if size < 96 else "blob_bytes"):
            model.prefix_from_bytes(blob[:size])


@settings(max_examples=200)
@given(data=st.data())
def test_a_flipped_byte_fails_the_checksum(saved, data):
    model, blob = saved
    at = data.draw(st.integers(8, len(blob) - 1), "offset")     # past the magic
    flip = data.draw(st.integers(1, 255), "xor")
    broken = bytearray(blob)
    broken[at] ^= flip
    version = struct.unpack_from("<I", broken, 8)[0]           # 1 ^ 3 is version 2, valid
    named = ("version" if at < 12 and version not in (1, 2) else "header_bytes" if 12 <= at < 16
             else "blob_bytes" if 16 <= at < 24 else "checksum")
    with pytest.raises(PrefixFormatError, match=named):
        model.prefix_from_bytes(bytes(broken))


@settings(max_examples=300)
@given(data=st.data())
def test_mutations_behind_a_valid_checksum_fail_cleanly_or_load(saved, data):
    """Random byte edits with the checksum recomputed (so every rule past it is reached):
    the loader raises PrefixFormatError, or the blob describes a prefix, which then saves a
    blob that loads."""
    model, blob = saved
    broken = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4), "edits")):
        at = data.draw(st.one_of(st.integers(28, 95), st.integers(28, len(blob) - 1)), "offset")
        broken[at] = data.draw(st.integers(0, 255), "byte")
    broken = with_checksum(broken)
    try:
        prefix = model.prefix_from_bytes(broken)
    except PrefixFormatError:
        return
    model.prefix_from_bytes(prefix.to_bytes())


def test_a_blob_of_another_model_is_refused(saved, models):
    _, blob = saved
    with pytest.raises(PrefixFormatError, match=r"saved from another model \(checksum 0x"):
        models["int8-gqa"].prefix_from_bytes(blob)


@pytest.mark.parametrize("loader", ["numpy", "native"])
def test_a_blob_of_the_other_kv_mode_is_refused(saved, loader):
    model, blob = saved
    if loader == "native":
        require_backend("native")
    with tinyloop.Model(model.path, backend=loader, kv_mode="int4") as int4:
        with pytest.raises(PrefixFormatError,
                           match="saved with kv_mode int8; this model runs int4"):
            int4.prefix_from_bytes(blob)
        blob4 = int4.build_prefix_cache(list(range(5, 45)), loops=2, cache_window=7,
                                        warm_start=True).to_bytes()
        assert int4.prefix_from_bytes(blob4).to_bytes() == blob4
        with pytest.raises(PrefixFormatError, match="saved with kv_mode int4"):
            model.prefix_from_bytes(blob4)
        # a nibble of -8 (0x8) in either half of a stored byte is refused
        n = struct.unpack_from("<Q", blob4, 56)[0]
        kv_at = 96 + 4 * n + 4 * 2 * model.config()["d_model"]
        for byte in (0x08, 0x80, 0x18):
            with pytest.raises(PrefixFormatError, match="kv: slot 0"):
                int4.prefix_from_bytes(patched(blob4, kv_at, "<B", byte))


def test_native_refuses_another_models_blob(saved, models, require_native):
    _, blob = saved
    with tinyloop.Model(models["int8-gqa"].path, backend="native") as native:
        with pytest.raises(PrefixFormatError, match="another model"):
            native.prefix_from_bytes(blob)


def test_buffers_and_closed_models(saved, model_files):
    model, blob = saved
    for buffer in (bytearray(blob), memoryview(blob), np.frombuffer(blob, np.uint8).data):
        assert model.prefix_from_bytes(buffer).to_bytes() == blob
    with pytest.raises(ValueError, match="blob must be bytes"):
        model.prefix_from_bytes(list(blob))
    fortran = np.asfortranarray(np.frombuffer(blob[:len(blob) // 2 * 2], np.uint8)
                                .reshape(2, -1)).data
    for strided in (memoryview(blob)[::2], fortran):
        with pytest.raises(ValueError, match="C-contiguous"):
            model.prefix_from_bytes(strided)
    with tinyloop.Model(model_files["int8-v2-coda"], backend="numpy") as closing:
        prefix = closing.prefix_from_bytes(blob)
    with pytest.raises(RuntimeError, match="model was closed"):
        closing.prefix_from_bytes(blob)
    with pytest.raises(RuntimeError, match="model was closed"):
        prefix.to_bytes()
