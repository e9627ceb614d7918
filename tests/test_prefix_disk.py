"""The disk tier of the automatic prefix cache (docs/spec.md §4.3.1, §7.6) on every backend:
evicted blocks become files named by the FNV-1a hash of their key (computed here from the
spec), holding the KV a prefix blob of the same tokens holds (§7.2, the kv storage path); a
fresh model on the directory reads them back with the same tokens and bit-identical logits as
a model without any cache; the disk budget keeps the most recently used files, across
restarts; close spills what is still cached; a corrupted, truncated, foreign or other-kv_mode
file is a miss that changes nothing; numpy and native write the same bytes and read each
other's files; bad arguments are refused. The server restarted on the same directory answers
a repeated chat from disk with the same reply.
"""
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tinyloop
from tinyloop.quickbench import backend_kwargs

from conftest import MODEL_SHAPES, assert_same_generation, backend_given, require_backend
from serve_process import serve_process
from test_prefix_blob import patched, with_checksum

BLOCK = 4
SHAPE = MODEL_SHAPES["int8-gqa"]          # vocab 263, G=2, D=8, n_pre 1, default loops 3
CODA = MODEL_SHAPES["int8-v2-coda"]       # G=2, D=8, n_pre 1, 2 core + 1 coda, loops 2
LIBRARY_BACKENDS = ("native", "native-cuda")
HEADER = struct.Struct("<8sIIQIIQIIIIIIIII20s")   # §7.6, 96 bytes
FIELDS = ("magic version header_bytes file_bytes checksum model_checksum model_file_bytes "
          "kv_mode window tree_depth block_size salt_bytes block_index n_layers n_kv_heads "
          "head_dim reserved").split()
KV_MODES = {"int8": 0, "int4": 1}


# -- the spec, written out independently -------------------------------------------------------
def fnv1a64(data):
    h = 0xcbf29ce484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001b3) % (1 << 64)
    return h


def model_identity(path):
    """(header checksum, file_bytes) of a .tinyloop file (§6.1 offsets 24 and 16)."""
    with open(path, "rb") as f:
        head = f.read(32)
    return struct.unpack_from("<I", head, 24)[0], struct.unpack_from("<Q", head, 16)[0]


def block_name(model, tokens, salt="", window=0, depth=0):
    """§4.3.1's file name of the block ending `tokens`."""
    checksum, file_bytes = model_identity(model.path)
    salt = salt.encode()
    key = struct.pack("<IQIIIII", checksum, file_bytes, KV_MODES[model.kv_mode], window, depth,
                      BLOCK, len(salt))
    return f"{fnv1a64(key + salt + np.asarray(tokens, '<i4').tobytes()):016x}.tlblock"


def names_of(model, prompts, **tree):
    """The file names of every full block of every prompt."""
    return {block_name(model, p[:(i + 1) * BLOCK], **tree)
            for p in prompts for i in range(len(p) // BLOCK)}


def read_block_file(path):
    """(header fields, salt, tokens, records (n_layers, bs, G) of 2R + 8 bytes) of a file."""
    data = open(path, "rb").read()
    h = dict(zip(FIELDS, HEADER.unpack_from(data)))
    at = 96 + h["salt_bytes"]
    n = (h["block_index"] + 1) * h["block_size"]
    tokens = np.frombuffer(data, "<i4", n, at)
    records = np.frombuffer(data, np.uint8, offset=at + 4 * n).reshape(
        h["n_layers"], h["block_size"], h["n_kv_heads"], -1)
    return h, data[96:at], tokens, records


def blob_records(blob):
    """(kv_start, records (n_layers, n - kv_start, G, 2R + 8)) of a version-1 prefix blob
    without states."""
    n, kv_start = struct.unpack_from("<QQ", blob, 56)
    loops, n_layers, g, d = (struct.unpack_from("<I", blob, at)[0] for at in (44, 72, 76, 84))
    body = np.frombuffer(blob, np.uint8, offset=96 + 4 * n + 4 * loops * d)
    return kv_start, body.reshape(n_layers, n - kv_start, g, -1)


def one_block_budget(backend, path, kv_mode="int8"):
    """A prefix cache budget holding one SINGLES block (at the default depth), not two."""
    with open_model(backend, path, 1 << 20, kv_mode=kv_mode) as model:
        model.generate(SINGLES[0], max_tokens=1)
        stats = model.cache_stats()
    assert stats["blocks"] == 1
    return stats["bytes_in_use"] + 1


def lookup_names(model, prompts, **tree):
    """The file names of every block a lookup of each prompt walks (all but the last token)."""
    return {block_name(model, p[:(i + 1) * BLOCK], **tree)
            for p in prompts for i in range((len(p) - 1) // BLOCK)}


def block_bytes(backend, n_layers, G=SHAPE["n_kv_heads"], D=SHAPE["head_dim"]):
    """Bytes of one cached block in memory (docs/api.md, "Memory")."""
    if backend in LIBRARY_BACKENDS:
        return 64 + n_layers * G * -(-(2 * BLOCK * D + 8 * BLOCK) // 64) * 64
    return n_layers * 2 * BLOCK * G * (D + 4)


def file_bytes(n_layers, index, salt=b"", G=SHAPE["n_kv_heads"], R=SHAPE["head_dim"]):
    """§7.6's size of a block file."""
    return 96 + len(salt) + 4 * (index + 1) * BLOCK + n_layers * BLOCK * G * (2 * R + 8)


# -- models ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk")
    made = {}
    for name, shape, seed in (("gqa", SHAPE, 11), ("coda", CODA, 12), ("other", SHAPE, 13)):
        made[name] = root / f"{name}.tinyloop"
        tinyloop.random_model(made[name], seed=seed, **shape)
    return made


def open_model(backend, path, budget=0, directory=None, **kwargs):
    return tinyloop.Model(path, **backend_kwargs(backend), block_size=BLOCK,
                          prefix_cache_bytes=budget, prefix_cache_dir=directory, **kwargs)


def tlblocks(directory):
    return sorted(n for n in os.listdir(directory) if n.endswith(".tlblock"))


def run_all(model, prompts, **kwargs):
    return [model.generate(p, max_tokens=3, return_logits=True, **kwargs) for p in prompts]


def assert_all_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert_same_generation(g, w)


# distinct first blocks: with room for one block in memory, each request evicts the last one
SINGLES = [[7 + 10 * k + j for j in range(BLOCK + 1)] for k in range(6)]
SHARED = [list(range(1, 23)), list(range(30, 60)), list(range(1, 23)) + [5, 6, 7],
          list(range(30, 50)) + [9]]

CASES = {"int8": dict(shape="gqa", kv_mode="int8", tree={}),
         "int4-salt": dict(shape="gqa", kv_mode="int4", tree=dict(salt="tenant")),
         "window": dict(shape="gqa", kv_mode="int8", tree=dict(window=6)),
         "coda": dict(shape="coda", kv_mode="int8", tree=dict(depth=CODA["default_loops"]))}


@pytest.mark.parametrize("case", sorted(CASES))
def test_evicted_blocks_become_files_named_by_their_key_holding_their_kv(backend, paths,
                                                                         tmp_path, case):
    c = CASES[case]
    path, tree = paths[c["shape"]], c["tree"]
    kwargs = dict(cache_salt=tree.get("salt"), cache_window=tree.get("window", 0))
    with open_model(backend, path, one_block_budget(backend, path, c["kv_mode"]), tmp_path / "d",
                    kv_mode=c["kv_mode"]) as model:
        run_all(model, SINGLES, **kwargs)
        stats = model.cache_stats()
        files = tlblocks(tmp_path / "d")
        assert stats["spilled_blocks"] == len(SINGLES) - 1 == len(files), stats
        assert set(files) == names_of(model, SINGLES[:-1], **tree)
        assert stats["disk_bytes"] == sum(os.path.getsize(tmp_path / "d" / f) for f in files)
        n_layers = model.config()["n_pre_blocks"] + model.config()["default_loops"] * (
            model.config()["n_core_blocks"] + model.config()["n_coda_blocks"])
        for prompt in SINGLES[:-1]:
            h, salt, tokens, records = read_block_file(
                tmp_path / "d" / block_name(model, prompt[:BLOCK], **tree))
            assert h["magic"] == b"TLPBLOCK" and (h["version"], h["header_bytes"]) == (1, 96)
            assert (h["model_checksum"], h["model_file_bytes"]) == model_identity(path)
            assert (h["kv_mode"], h["window"], h["tree_depth"], h["block_size"]) == (
                KV_MODES[c["kv_mode"]], tree.get("window", 0), tree.get("depth", 0), BLOCK)
            assert salt == tree.get("salt", "").encode() and h["block_index"] == 0
            assert h["n_layers"] == n_layers and tokens.tolist() == prompt[:BLOCK]
            # the KV the kv storage path holds for the same tokens: a prefix blob's records
            blob = model.build_prefix_cache(prompt[:BLOCK], cache_window=kwargs["cache_window"],
                                            storage="kv").to_bytes()
            kv_start, want = blob_records(blob)
            assert kv_start == 0
            written = written_slots(model.config())
            assert np.array_equal(records[written], want[written])
            assert not records[~written].any(), "a slot no request writes is not zeros"


def written_slots(cfg):
    """(n_layers,) bool: the slots a request at the default depth writes (the coda slots of
    shallower depths it does not)."""
    k, c, L = cfg["n_core_blocks"], cfg["n_coda_blocks"], cfg["default_loops"]
    per = [True] * cfg["n_pre_blocks"]
    for i in range(L):
        per += [True] * k + [i == L - 1] * c
    return np.array(per)


def test_a_fresh_model_on_the_directory_hits_with_identical_results(backend, paths, tmp_path):
    with open_model(backend, paths["gqa"]) as plain:
        want = run_all(plain, SHARED)
    with open_model(backend, paths["gqa"], block_bytes(backend, 4) * 2, tmp_path) as first:
        assert_all_same(run_all(first, SHARED), want)
        assert first.cache_stats()["spilled_blocks"] > 0
    with open_model(backend, paths["gqa"], 1 << 20, tmp_path) as second:
        assert_all_same(run_all(second, SHARED), want)
        stats = second.cache_stats()
    assert stats["disk_hit_blocks"] > 0 and stats["evicted_blocks"] == 0, stats
    assert stats["inserted_blocks"] + stats["disk_hit_blocks"] == stats["blocks"]


def test_the_disk_budget_keeps_the_most_recently_used_files(backend, paths, tmp_path):
    one = file_bytes(4, 0)                                    # every SINGLES block: index 0
    budget = dict(budget=one_block_budget(backend, paths["gqa"]), directory=tmp_path)
    with open_model(backend, paths["gqa"], **budget, prefix_cache_disk_bytes=2 * one) as model:
        run_all(model, SINGLES[:5])                           # spills blocks of 0 .. 3
        assert set(tlblocks(tmp_path)) == names_of(model, SINGLES[2:4])
        stats = model.cache_stats()
        assert (stats["spilled_blocks"], stats["disk_bytes"], stats["disk_budget_bytes"]) == (
            4, 2 * one, 2 * one)
    # close spilled 4's block, removing 2's, the least recently used
    assert set(tlblocks(tmp_path)) == names_of(model, [SINGLES[3], SINGLES[4]])
    os.utime(tmp_path / block_name(model, SINGLES[3][:BLOCK]), (1, 1))    # 3's file: oldest
    with open_model(backend, paths["gqa"], **budget, prefix_cache_disk_bytes=2 * one) as model:
        assert model.cache_stats()["disk_bytes"] == 2 * one                 # found at open
        model.generate(SINGLES[3], max_tokens=1)           # a hit: 3's file the newest now
        assert model.cache_stats()["disk_hit_blocks"] == 1
        model.generate(SINGLES[5], max_tokens=1)           # evicts (and skips rewriting) 3's
        model.generate(SINGLES[0], max_tokens=1)           # evicts 5's: its file replaces 4's
        assert set(tlblocks(tmp_path)) == names_of(model, [SINGLES[3], SINGLES[5]])
    with open_model(backend, paths["gqa"], **budget, prefix_cache_disk_bytes=one - 1) as model:
        model.generate(SINGLES[1], max_tokens=1)
        model.generate(SINGLES[2], max_tokens=1)           # 1's file is larger than the budget
        assert model.cache_stats()["spilled_blocks"] == 0
    assert len(tlblocks(tmp_path)) == 2


def test_a_file_another_model_wrote_joins_the_count_when_read(backend, paths, tmp_path):
    """§4.3.1: each counts the files it found at open, read or wrote."""
    with open_model(backend, paths["gqa"], 1 << 20, tmp_path) as reader:
        with open_model(backend, paths["gqa"], 1 << 20, tmp_path) as writer:
            writer.generate(SHARED[0], max_tokens=1)           # close: 5 files
        assert len(tlblocks(tmp_path)) == 5 and reader.cache_stats()["disk_bytes"] == 0
        reader.generate(SHARED[0], max_tokens=1)               # reads blocks 0 .. 4
        stats = reader.cache_stats()
    read = lookup_names(reader, [SHARED[0]])
    assert stats["disk_hit_blocks"] == len(read) == 5
    assert stats["disk_bytes"] == sum(os.path.getsize(tmp_path / name) for name in read)


def test_close_spills_every_cached_block_and_clear_writes_nothing(backend, paths, tmp_path):
    with open_model(backend, paths["gqa"], 1 << 20, tmp_path / "a") as model:
        run_all(model, SHARED)
        model.clear_prefix_cache()
        assert tlblocks(tmp_path / "a") == []
        run_all(model, SHARED)
        assert tlblocks(tmp_path / "a") == [] and model.cache_stats()["spilled_blocks"] == 0
        blocks = model.cache_stats()["blocks"]
    assert set(tlblocks(tmp_path / "a")) == names_of(model, SHARED)
    assert len(tlblocks(tmp_path / "a")) == blocks


def test_close_spills_the_deepest_block_of_a_tick_first_so_a_tight_budget_keeps_the_shallow(
        backend, paths, tmp_path):
    """One prompt's 5 blocks share a tick: close writes blocks 4, 3, .., 0 (libtinyloop's use
    list), and a disk budget of blocks 0 and 1 keeps those two, what a later walk needs."""
    prompt = SHARED[0]                                        # 22 tokens: blocks 0 .. 4
    budget = dict(prefix_cache_disk_bytes=file_bytes(4, 0) + file_bytes(4, 1))
    with open_model(backend, paths["gqa"], 1 << 20, tmp_path, **budget) as model:
        model.generate(prompt, max_tokens=1)
        assert model.cache_stats()["blocks"] == 5
    assert set(tlblocks(tmp_path)) == names_of(model, [prompt[:2 * BLOCK]])
    with open_model(backend, paths["gqa"]) as plain:
        want = run_all(plain, [prompt])
    with open_model(backend, paths["gqa"], 1 << 20, tmp_path, **budget) as model:
        assert_all_same(run_all(model, [prompt]), want)
        assert model.cache_stats()["disk_hit_blocks"] == 2


# -- bad files ---------------------------------------------------------------------------------
def corruptions(good, foreign, int4):
    """name -> the bytes to put under a block's name instead of `good`."""
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x10
    at = len(good) - BLOCK * 2 * (2 * 8 + 8)                 # the last slot's first kq byte
    bad_row = patched(good, at, "<B", 0x80)                   # -128, a valid checksum
    return {"truncated": good[:-1], "header only": good[:96], "empty": b"",
            "flipped": bytes(flipped),
            "-128 behind a valid checksum": bad_row, "another model": foreign,
            "int4 kv_mode": int4}


def test_a_bad_file_is_a_miss_that_changes_nothing(backend, paths, tmp_path):
    prompt = SINGLES[0]
    files = {}
    for label, path, kv_mode in (("good", "gqa", "int8"), ("foreign", "other", "int8"),
                                 ("int4", "gqa", "int4")):
        with open_model(backend, paths[path], 1 << 20, tmp_path / label, kv_mode=kv_mode) as m:
            m.generate(prompt, max_tokens=1)
        (only,) = tlblocks(tmp_path / label)
        files[label] = (tmp_path / label / only).read_bytes()
    with open_model(backend, paths["gqa"]) as plain:
        want = plain.generate(prompt, max_tokens=3, return_logits=True)
        name = block_name(plain, prompt[:BLOCK])
    for label, data in corruptions(files["good"], files["foreign"], files["int4"]).items():
        directory = tmp_path / label.replace(" ", "-")
        directory.mkdir()
        (directory / name).write_bytes(data)
        with open_model(backend, paths["gqa"], 1 << 20, directory) as model:
            assert_same_generation(model.generate(prompt, max_tokens=3, return_logits=True), want)
            assert model.cache_stats()["disk_hit_blocks"] == 0, label
        assert (directory / name).read_bytes() == files["good"], f"{label}: not rewritten"


def test_a_fifo_under_a_blocks_name_is_a_miss_not_a_hang(backend, paths, tmp_path):
    prompt = SINGLES[0]
    with open_model(backend, paths["gqa"]) as plain:
        want = plain.generate(prompt, max_tokens=3, return_logits=True)
        name = block_name(plain, prompt[:BLOCK])
    os.mkfifo(tmp_path / name)                       # opening it blocking would wait forever
    with open_model(backend, paths["gqa"], 1 << 20, tmp_path) as model:
        assert_same_generation(model.generate(prompt, max_tokens=3, return_logits=True), want)
        assert model.cache_stats()["disk_hit_blocks"] == 0
    assert stat.S_ISREG(os.stat(tmp_path / name).st_mode)      # the close spilled over it


@pytest.fixture(scope="module")
def numpy_tier(paths, tmp_path_factory):
    """(the numpy engine's disk tier, a good file's bytes)."""
    directory = tmp_path_factory.mktemp("tier")
    with open_model("numpy", paths["gqa"], 1 << 20, directory) as model:
        model.generate(SINGLES[0], max_tokens=1)
    model = open_model("numpy", paths["gqa"], 1 << 20, directory)
    (only,) = tlblocks(directory)
    yield model._engine.prefix_cache.disk, (directory / only).read_bytes()
    model.close()


def test_the_python_reader_refuses_every_truncation(numpy_tier):
    from tinyloop.fallback.pcache_disk import BlockFileError
    tier, good = numpy_tier
    tier.parse(good)
    for size in range(len(good)):
        with pytest.raises(BlockFileError, match="too small" if size < 96 else "file_bytes"):
            tier.parse(good[:size])


@settings(max_examples=300)
@given(data=st.data())
def test_mutations_behind_a_valid_checksum_fail_cleanly_or_parse(numpy_tier, data):
    from tinyloop.fallback.pcache_disk import BlockFileError
    tier, good = numpy_tier
    broken = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4), "edits")):
        broken[data.draw(st.integers(0, len(good) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans(), "recompute the checksum"):
        broken = with_checksum(broken)
    try:
        tier.parse(bytes(broken))
    except BlockFileError:
        pass


# -- across backends ---------------------------------------------------------------------------
def test_numpy_and_native_write_the_same_files_and_read_each_others(paths, tmp_path):
    require_backend("native")
    for backend in ("numpy", "native"):
        with open_model(backend, paths["coda"], 1 << 20, tmp_path / backend) as model:
            run_all(model, SHARED)
            run_all(model, SHARED[:2], cache_salt="s", cache_window=5, loops=1)
    names = tlblocks(tmp_path / "numpy")
    assert names == tlblocks(tmp_path / "native") and names
    for name in names:
        assert (tmp_path / "numpy" / name).read_bytes() == (tmp_path / "native" / name).read_bytes()
    with open_model("numpy", paths["coda"]) as plain:
        want = run_all(plain, SHARED)
    for reader, writer in (("numpy", "native"), ("native", "numpy")):
        copy = tmp_path / f"{writer}-for-{reader}"
        shutil.copytree(tmp_path / writer, copy)
        with open_model(reader, paths["coda"], 1 << 20, copy) as model:
            assert_all_same(run_all(model, SHARED), want)
            assert model.cache_stats()["disk_hit_blocks"] == len(lookup_names(model, SHARED))


@st.composite
def workloads(draw):
    systems = draw(st.lists(st.lists(st.integers(0, SHAPE["vocab_size"] - 1), min_size=1,
                                     max_size=16), min_size=1, max_size=3))
    tails = st.lists(st.integers(0, SHAPE["vocab_size"] - 1), max_size=6)
    return [(draw(st.sampled_from(systems)) + draw(tails),
             dict(loops=draw(st.integers(1, 3)), cache_window=draw(st.sampled_from([0, 0, 5])),
                  cache_salt=draw(st.sampled_from([None, "a"])),
                  prefill_chunk=draw(st.integers(1, 8))))
            for _ in range(draw(st.integers(1, 5)))]


@backend_given(first=workloads(), then=workloads(), blocks=st.integers(0, 4),
               disk_files=st.integers(0, 4))
def test_random_workloads_and_budgets_match_no_cache(backend, paths, tmp_path_factory, first,
                                                     then, blocks, disk_files):
    """A model on a fresh directory, then one restarted on it, under drawn budgets (in
    blocks and files of the default depth): every result is the cache-less model's."""
    directory = tmp_path_factory.mktemp("prop")
    options = dict(budget=block_bytes(backend, 4) * blocks + 1, directory=directory,
                   prefix_cache_disk_bytes=file_bytes(4, 3) * disk_files)
    with open_model(backend, paths["gqa"]) as plain:
        for requests in (first, first + then):
            with open_model(backend, paths["gqa"], **options) as cached:
                for prompt, kwargs in requests:
                    assert_same_generation(
                        cached.generate(prompt, max_tokens=2, return_logits=True, **kwargs),
                        plain.generate(prompt, max_tokens=2, return_logits=True, **kwargs))
                stats = cached.cache_stats()
            assert not disk_files or stats["disk_bytes"] <= stats["disk_budget_bytes"]


# -- arguments ---------------------------------------------------------------------------------
def test_bad_arguments_are_refused(backend, paths, tmp_path):
    with pytest.raises(ValueError, match="prefix_cache_disk_bytes < 0"):
        open_model(backend, paths["gqa"], 1 << 20, tmp_path, prefix_cache_disk_bytes=-1)
    with pytest.raises(ValueError, match="prefix_cache_dir needs prefix_cache_bytes > 0"):
        open_model(backend, paths["gqa"], 0, tmp_path)
    with pytest.raises(ValueError, match="prefix_cache_dir must be a path .* got int"):
        open_model(backend, paths["gqa"], 1 << 20, 5)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(OSError, match="a-file"):
        open_model(backend, paths["gqa"], 1 << 20, a_file)
    with pytest.raises(OSError, match="missing"):
        open_model(backend, paths["gqa"], 1 << 20, tmp_path / "missing" / "two-levels")
    with open_model(backend, paths["gqa"], 1 << 20, tmp_path / "made") as model:
        assert os.path.isdir(tmp_path / "made")
        assert model.cache_stats()["disk_budget_bytes"] == 0


def test_serve_refuses_a_cache_dir_without_a_cache_before_serving(capsys, tmp_path):
    from tinyloop.cli import main
    assert main(["serve", "--prefix-cache-dir", str(tmp_path), "--prefix-cache-bytes", "0"]) == 2
    assert "--prefix-cache-dir needs --prefix-cache-bytes > 0" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_a_salt_longer_than_a_file_may_hold_is_never_spilled(backend, paths, tmp_path):
    """§7.6: salt_bytes <= 65536. Blocks of a longer salt are evicted without a file."""
    with open_model(backend, paths["gqa"], one_block_budget(backend, paths["gqa"]),
                    tmp_path) as model:
        run_all(model, SINGLES[:3], cache_salt="s" * 65537)
        run_all(model, SINGLES[:3], cache_salt="s" * 65536)
        stats = model.cache_stats()
    assert (stats["evicted_blocks"], stats["spilled_blocks"]) == (5, 2), stats
    assert set(tlblocks(tmp_path)) == names_of(model, SINGLES[:3], salt="s" * 65536)   # + close


# -- the server --------------------------------------------------------------------------------
CHAT = [{"role": "system", "content": "you are a terse assistant who answers in one line"},
        {"role": "user", "content": "tell me about the quick brown fox and the lazy dog"}]


def serve_once(backend, model, directory, tmp_path, name):
    """`tinyloop serve --prefix-cache-dir DIR` in a process of its own: one chat request
    (the official openai client), the metrics, then Ctrl-C (the model closes and spills)."""
    openai = pytest.importorskip("openai")
    args = [str(model), "--model-name", "chat", "--max-batch", "2", "--step-tokens", "64",
            *(["--backend", backend] if backend not in LIBRARY_BACKENDS else
              ["--backend", "native", "--device", "cuda" if backend == "native-cuda" else "cpu"]),
            "--prefix-cache-dir", str(directory), "--prefix-cache-disk-bytes", "1000000"]
    with serve_process(args, tmp_path / f"{name}.log") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="chat", messages=CHAT, seed=3,
                                               max_completion_tokens=8)
        metrics = served_metrics(url)
    return reply.choices[0].message.content, reply.usage, metrics


def dead_pid():
    """The id of a process that no longer runs (a child's, reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def stale_temps(directory):
    return [n for n in os.listdir(directory) if n.endswith(".tmp")]


def test_a_killed_writers_temporary_file_is_removed_at_open(backend, paths, tmp_path):
    """§4.3.1: a writer killed between creating `.<name>.<pid>.<n>.tmp` and renaming it leaves
    the file; the next open removes it (no budget would ever count it), keeps those of a
    process still running, and counts the block files as before."""
    with open_model(backend, paths["gqa"], 1 << 20, tmp_path) as model:
        model.generate(SHARED[0], max_tokens=1)                # close: 5 files
    name = tlblocks(tmp_path)[0]
    stale, live = f".{name}.{dead_pid()}.0.tmp", f".{name}.{os.getpid()}.1.tmp"
    for temp in (stale, live):
        (tmp_path / temp).write_bytes(b"partial")
    with open_model(backend, paths["gqa"], 1 << 20, tmp_path) as model:
        assert stale_temps(tmp_path) == [live]
        assert model.cache_stats()["disk_bytes"] == sum(
            os.path.getsize(tmp_path / n) for n in tlblocks(tmp_path))


FULL_DISK_RUN = """
import json, resource, sys
import tinyloop
from tinyloop.quickbench import backend_kwargs
backend, path, directory, budget, prompts = json.loads(sys.argv[1])
with tinyloop.Model(path, **backend_kwargs(backend), block_size=4,
                    prefix_cache_bytes=budget) as warm:   # numba compiles (and caches) first
    [warm.generate(p, max_tokens=3) for p in prompts]
limit = 200          # bytes: below any block file, so every write fails as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
with tinyloop.Model(path, **backend_kwargs(backend), block_size=4, prefix_cache_bytes=budget,
                    prefix_cache_dir=directory) as model:
    out = [model.generate(p, max_tokens=3) for p in prompts]
    stats = model.cache_stats()
print(json.dumps([out, stats]))
"""


def test_a_full_disk_leaves_the_cache_in_memory_and_counts_the_failed_writes(backend, paths,
                                                                              tmp_path):
    """§4.3.1 under a full disk (a process whose file size limit is below any block file, so
    every write fails as with ENOSPC): every generation is still the cache-less one, each
    spill is counted in disk_write_failures and none in spilled_blocks, and the directory holds
    no file, not even a temporary one."""
    require_backend(backend)
    run = subprocess.run([sys.executable, "-c", FULL_DISK_RUN,
                          json.dumps([backend, str(paths["gqa"]), str(tmp_path),
                                      block_bytes(backend, 4), SINGLES])],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out, stats = json.loads(run.stdout)
    with open_model(backend, paths["gqa"]) as plain:
        assert out == [plain.generate(p, max_tokens=3) for p in SINGLES]
    assert stats["spilled_blocks"] == 0 and stats["disk_bytes"] == 0
    assert stats["disk_write_failures"] == len(SINGLES) - 1   # each evicted by the next
    assert os.listdir(tmp_path) == []


# Eight chats differing in their system prompts: many blocks for a small cache to spill.
CHATS = [[dict(CHAT[0], content=f"{CHAT[0]['content']} number {i}"), CHAT[1]] for i in range(8)]


def ask_chat(url, messages):
    """A served chat's reply (seed 5, 6 tokens), through the official openai client."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return client.chat.completions.create(model="chat", messages=messages, seed=5,
                                          max_completion_tokens=6).choices[0].message.content


def served_metrics(url):
    parser = pytest.importorskip("prometheus_client.parser")
    httpx = pytest.importorskip("httpx")
    return {s.name: s.value for family in
            parser.text_string_to_metric_families(httpx.get(url + "/metrics").text)
            for s in family.samples}


def assert_answers_of_a_server_without_cache(model_path, answers, tmp_path):
    no_cache = [str(model_path), "--model-name", "chat", "--prefix-cache-bytes", "0"]
    with serve_process(no_cache, tmp_path / "fresh.log") as url:
        assert answers == [ask_chat(url, messages) for messages in CHATS]


def test_a_server_on_a_full_disk_serves_from_memory_and_says_so_in_metrics(tmp_path):
    """`tinyloop serve` whose disk tier cannot write a file (a file-size limit below any block
    file: every write fails as on a full disk) answers every chat as a server with no cache
    does, spills nothing and counts each failed write in /metrics."""
    pytest.importorskip("starlette")
    import resource
    from tiny_hf import hf_model
    model_path = hf_model(tmp_path / "chat.tinyloop")
    cache = tmp_path / "cache"

    def full_disk():
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, hard))

    args = [str(model_path), "--model-name", "chat", "--prefix-cache-bytes", "40000",
            "--prefix-cache-dir", str(cache)]
    with serve_process(args, os.devnull, preexec_fn=full_disk) as url:
        answers = [ask_chat(url, messages) for messages in CHATS]
        values = served_metrics(url)
    assert values["tinyloop_prefix_cache_disk_write_failures_total"] > 0
    assert values["tinyloop_prefix_cache_spilled_blocks_total"] == 0
    assert values["tinyloop_prefix_cache_disk_bytes"] == 0 and not os.listdir(cache)
    assert_answers_of_a_server_without_cache(model_path, answers, tmp_path)


def test_a_server_killed_while_spilling_restarts_with_the_same_answers(tmp_path):
    """kill -9 of `tinyloop serve` while four chats run and its prefix cache (room for a few
    blocks) spills on every eviction; a server started again on the directory counts exactly
    the block files there, leaves no temporary file of the killed one, and answers every chat
    as a fresh model with no cache does (no file it reads is torn: each was renamed whole)."""
    pytest.importorskip("starlette")
    from tiny_hf import hf_model
    model_path = hf_model(tmp_path / "chat.tinyloop")
    cache = tmp_path / "cache"
    args = [str(model_path), "--model-name", "chat", "--max-batch", "4", "--step-tokens", "64",
            "--prefix-cache-bytes", "40000", "--prefix-cache-dir", str(cache)]
    with serve_process(args, tmp_path / "killed.log", killed=True) as (url, process):
        for messages in CHATS[:4]:
            ask_chat(url, messages)                         # fill the cache, spill
        threads = [threading.Thread(target=_quietly, args=(ask_chat, url, m)) for m in CHATS[4:]]
        for thread in threads:
            thread.start()
        time.sleep(0.2)
        process.send_signal(signal.SIGKILL)
        for thread in threads:
            thread.join()
        killed_pid = process.pid
    assert tlblocks(cache), "the killed server had spilled nothing"
    (cache / f".{tlblocks(cache)[0]}.{killed_pid}.0.tmp").write_bytes(b"torn")  # as a kill leaves
    with serve_process(args, tmp_path / "again.log") as url:
        disk_bytes = served_metrics(url)["tinyloop_prefix_cache_disk_bytes"]
        assert disk_bytes == sum(os.path.getsize(cache / n) for n in tlblocks(cache))
        assert not stale_temps(cache)
        answers = [ask_chat(url, messages) for messages in CHATS]
    assert_answers_of_a_server_without_cache(model_path, answers, tmp_path)


def _quietly(call, *args):
    """call(*args), its failure ignored (a request to a server being killed)."""
    try:
        call(*args)
    except Exception:
        pass


def test_a_restarted_server_answers_a_repeated_chat_from_disk(backend, tmp_path):
    pytest.importorskip("starlette")
    from tiny_hf import hf_model
    model = hf_model(tmp_path / "chat.tinyloop")
    first, usage, metrics = serve_once(backend, model, tmp_path / "cache", tmp_path, "first")
    assert metrics["tinyloop_prefix_cache_disk_hit_blocks_total"] == 0
    assert tlblocks(tmp_path / "cache"), "the server spilled nothing at shutdown"
    again, usage_again, metrics = serve_once(backend, model, tmp_path / "cache", tmp_path, "again")
    assert again == first and usage_again == usage
    assert metrics["tinyloop_prefix_cache_disk_hit_blocks_total"] > 0
    assert metrics["tinyloop_cached_prompt_tokens_total"] > 0
