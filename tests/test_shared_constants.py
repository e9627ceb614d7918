"""What C (libtinyloop) and Python (tinyloop, tinyloop.fallback) must agree on, checked.

Each of these values is written in C and again in Python, and nothing generates one side from
the other, so these checks read the C sources and compare them with the Python modules:
limits, versions, the file format's numbers and codes, the fields of shared structs, the
spec's constants. Error messages are compared by behaviour: the same bad input goes to the
numpy backend through `tinyloop.Model` and straight to the C API through cffi (past the Python
checks that would otherwise answer first), and the messages must be the same.
"""
import dataclasses
import inspect
import math
import re
from pathlib import Path

import cffi
import numpy as np
import pytest

import tinyloop
from tinyloop import modelfile, native
from tinyloop import params as P
from tinyloop._library import ABI_VERSION, cdef_from_header
from tinyloop.config import MAX_STOP_IDS, ModelConfig
from tinyloop.engine import EXIT_DEFAULT_THRESHOLDS, EXIT_RULES, MAX_ARGMAX_STEPS, SCHED_STAT_NAMES
from tinyloop.fallback import numerics

from conftest import require_backend

C_ROOT = Path(__file__).resolve().parent.parent / "libtinyloop"
HEADER = C_ROOT / "include" / "tinyloop.h"
LOADER = C_ROOT / "src" / "core" / "loader.c"
GOOD = [1, 2, 3]


def c_sources():
    return sorted(p for p in (C_ROOT / "src").rglob("*") if p.suffix in (".c", ".h", ".cu", ".cuh"))


def c_source(relative):
    return (C_ROOT / "src" / relative).read_text()


def c_defined_once(name, pattern, files):
    found = [(p.name, m) for p in files for m in re.findall(pattern, p.read_text())]
    assert len(found) == 1, f"{name} must be defined once in libtinyloop, found {found}"
    return found[0][1]


def c_integer(name, files=None):
    """The enum constant or #define `name`, defined once in `files` (default: all of C)."""
    pattern = rf"(?:\b{name}\s*=\s*|#define\s+{name}\s+)(\d+)\b"
    return int(c_defined_once(name, pattern, files or [HEADER, *c_sources()]))


def c_float(name):
    """The literal of `#define name <float>f`, defined once in the C sources."""
    return c_defined_once(name, rf"#define {name} ([\d.e-]+)f\b", c_sources())


def f32_bits(value):
    return int(np.float32(value).view(np.uint32))


@pytest.fixture(scope="module")
def header_ffi():
    """The header as the Python binding declares it (no library needed)."""
    ffi = cffi.FFI()
    ffi.cdef(cdef_from_header(HEADER.read_text()))
    return ffi


def struct_fields(ffi, name):
    """Field names of a parameter or output struct, after its leading `size`."""
    names = [field for field, _ in ffi.typeof(name).fields]
    assert names[0] == "size", f"{name} must start with its size"
    return names[1:]


# ---- constants read from the sources ------------------------------------------------------

def test_loop_and_draft_limits_are_the_same_numbers():
    assert c_integer("TL_MAX_LOOPS") == P.MAX_LOOPS
    assert c_integer("TL_MAX_DRAFT") == P.MAX_DRAFT


def test_block_size_and_thread_limits_are_the_same_numbers():
    assert c_integer("TL_MAX_KV_BLOCK_SIZE") == P.MAX_BLOCK_SIZE
    assert c_integer("TL_POOL_MAX_THREADS") == P.MAX_THREADS


@pytest.mark.parametrize("argument, limit", [("block_size", P.MAX_BLOCK_SIZE), ("threads", P.MAX_THREADS)])
def test_every_backend_refuses_a_block_size_or_thread_count_past_the_limit(argument, limit):
    with pytest.raises(ValueError, match=f"{argument} must be <= {limit}, got {limit + 1}"):
        tinyloop.Model(backend="numpy", **{argument: limit + 1})


def test_versions_are_the_same():
    assert c_integer("TL_ABI_VERSION") == ABI_VERSION
    cmake = (C_ROOT / "CMakeLists.txt").read_text()
    project = re.search(r"project\(tinyloop VERSION ([\d.]+)", cmake)
    assert project and project.group(1) == tinyloop.__version__
    changelog = (C_ROOT.parent / "CHANGELOG.md").read_text()   # the newest release comes first,
    released = re.search(r"^## (\S+) (?!\(unreleased\))", changelog, re.M)  # after work to come
    assert released and released.group(1) == tinyloop.__version__


def test_file_format_numbers_are_the_same():
    for name in ("HEADER_BYTES", "ENTRY_BYTES", "ALIGN", "MAX_NDIM", "CHECKSUM_AT"):
        assert c_integer(name, [LOADER]) == getattr(modelfile, name), name
    loader = LOADER.read_text()
    magic = re.search(r'memcmp\(\w+, "(\w+)", (\d+)\)', loader)
    assert magic and magic.group(1).encode() == modelfile.MAGIC
    assert int(magic.group(2)) == len(modelfile.MAGIC)
    versions = re.search(r"version < (\d+) \|\| version > (\d+)", loader)
    assert versions
    assert tuple(range(int(versions[1]), int(versions[2]) + 1)) == modelfile.VERSIONS
    dtypes = {"DT_F32": "<f4", "DT_I8": "i1", "DT_U8": "u1", "DT_I32": "<i4"}
    codes = {c_integer(name, [LOADER]): np.dtype(kind) for name, kind in dtypes.items()}
    assert codes == modelfile.DTYPES
    assert c_integer("TL_MAX_STOP_IDS", [HEADER]) == MAX_STOP_IDS


def codes_in(text):
    """{code: name} of a phrase like "1 (int8) or 2 (int4)" or "0 = none, 1 = bytes"."""
    pairs = re.findall(r"(\d+) (?:\((\w+)\)|= (\w+))", text)
    return {int(code): paren or eq for code, paren, eq in pairs}


@pytest.mark.parametrize("field, python", [("weight_format", modelfile.WEIGHT_FORMATS),
                                           ("tokenizer", modelfile.TOKENIZERS),
                                           ("block_layout", modelfile.BLOCK_LAYOUTS)])
def test_file_codes_are_the_same(field, python):
    documented = re.search(rf"uint32_t {field};\s*/\*([^*]*)\*/", HEADER.read_text())
    checked = re.search(rf'"{field}: must be ([^"]*)"', LOADER.read_text())
    assert documented and codes_in(documented.group(1)) == python, "tinyloop.h"
    assert checked and codes_in(checked.group(1)) == python, "loader.c"
    assert getattr(native, field.upper() + "S") == python, "tinyloop/native.py"
    if field == "weight_format":
        named = {c_integer("TL_FORMAT_INT8"): "int8", c_integer("TL_FORMAT_INT4"): "int4"}
        assert named == python, "loader.h"


def test_shared_structs_have_the_python_fields(header_ffi):
    assert struct_fields(header_ffi, "tl_prefix_cache_stats") == list(P.CACHE_STAT_NAMES)
    assert struct_fields(header_ffi, "tl_sched_stats") == list(SCHED_STAT_NAMES)
    config_fields = [f.name for f in dataclasses.fields(ModelConfig)]
    # tl_model_config also reports the file's format version, which a ModelConfig does not
    # hold, and its stop_ids array carries their count beside it
    struct = struct_fields(header_ffi, "tl_model_config")
    assert [f for f in struct if f not in ("version", "n_stop_ids")] == config_fields


def exp2_coefficients(source, function):
    """C6 .. C0 (K6 .. K0 of log2s) as written in the Horner steps of `function` (each
    `p = ...` line's literal; a step without one, log2s's `p = p * s`, is skipped)."""
    body = source[source.index(f" {function}("):]
    body = body[:body.index("\n}\n")]
    return [re.findall(r"(\d+\.\d+(?:e-?\d+)?)f", line)[-1]
            for line in body.splitlines() if re.match(r"\s*(?:float |__m256 )?p = ", line)
            and re.search(r"\d\.\d+(?:e-?\d+)?f", line)]


def test_exit_rules_are_the_same():
    assert [c_integer(f"TL_EXIT_{name.upper()}") for name in EXIT_RULES] == list(range(len(EXIT_RULES)))
    assert EXIT_DEFAULT_THRESHOLDS.keys() == {"latent", "kl", "argmax"}   # gate: the model file's
    for name, value in EXIT_DEFAULT_THRESHOLDS.items():
        assert f32_bits(c_float(f"TL_EXIT_{name.upper()}_DEFAULT")) == f32_bits(value), name
    assert c_integer("TL_EXIT_ARGMAX_MAX") == MAX_ARGMAX_STEPS


def test_spec_constants_are_the_same_bits():
    want = [f32_bits(c) for c in numerics.EXP2_COEFFS[::-1]]                 # C6 .. C0
    for path, function in (("core/numerics.h", "tl_exp2s"), ("cpu/numerics_avx2.h", "tl_exp2s8")):
        assert [f32_bits(c) for c in exp2_coefficients(c_source(path), function)] == want, path
    assert f32_bits(c_float("TL_LOG2E")) == f32_bits(numerics.LOG2E)
    want = [f32_bits(c) for c in numerics.LOG2_COEFFS[::-1]]                 # K6 .. K0 (§2.8)
    got = exp2_coefficients(c_source("core/numerics.h"), "tl_log2s")
    assert [f32_bits(c) for c in got] == want
    assert f32_bits(c_float("TL_LN2")) == f32_bits(numerics.LN2)
    # every Q8 kernel's tiny-row test `amax < X` (X a literal or a #define), spec §2.2 step 2
    thresholds = [(p.name, x) for p in c_sources()
                  for x in re.findall(r"amax < ([\w.-]+?)f?\)", p.read_text())]
    assert thresholds, "no Q8 threshold found in libtinyloop"
    for where, x in thresholds:
        literal = x if x[0].isdigit() else c_float(x)
        assert f32_bits(literal) == f32_bits(numerics.Q_TINY), f"Q8 threshold {x} in {where}"


# ---- behaviour: the library against the Python layer --------------------------------------

class CModel:
    """A model opened straight through libtinyloop's C API, with none of tinyloop's checks."""

    def __init__(self, path):
        from tinyloop.backends import native_library
        self.ffi, self.lib, _, _ = native_library()
        out = self.ffi.new("tl_model**")
        assert self.lib.tl_model_open(str(path).encode(), self.ffi.NULL, out) == self.lib.TL_OK
        self.handle = self.ffi.gc(out[0], self.lib.tl_model_free)

    def error(self, status):
        assert status != self.lib.TL_OK, "libtinyloop accepted what the Python layer refuses"
        return self.ffi.string(self.lib.tl_last_error()).decode()

    def _tokens(self, tokens):
        return self.ffi.new("int32_t[]", list(tokens)), len(tokens)

    def _params(self, keep, stop_sequences=(), **fields):
        p = self.ffi.new("tl_gen_params*", self.lib.tl_gen_params_default())
        for name, value in fields.items():
            setattr(p, name, value)
        if stop_sequences:
            keep.append(self.ffi.new("int32_t[]", [t for seq in stop_sequences for t in seq]))
            keep.append(self.ffi.new("size_t[]", [len(seq) for seq in stop_sequences]))
            p.stop_tokens, p.stop_lengths, p.n_stop = keep[-2], keep[-1], len(stop_sequences)
        return p

    def generate(self, tokens=GOOD, prefix=None, **fields):
        """The message of a failing tl_generate of `tokens`, or with `prefix` ((loops,
        cache_window) of a prefix of GOOD, built first) of tl_generate_from_prefix."""
        keep = []
        p = self._params(keep, **fields)
        out_tokens, n_out = self.ffi.new("int32_t[]", max(p.max_tokens, 1)), self.ffi.new("size_t*")
        tokens, n = self._tokens(tokens)
        if prefix is None:
            return self.error(self.lib.tl_generate(self.handle, tokens, n, p, out_tokens, n_out,
                                                   self.ffi.NULL))
        out = self.ffi.new("tl_prefix**")
        good, n_good = self._tokens(GOOD)
        status = self.lib.tl_prefix_build(self.handle, good, n_good, *prefix, 0, out)
        assert status == self.lib.TL_OK
        built = self.ffi.gc(out[0], self.lib.tl_prefix_free)
        return self.error(self.lib.tl_generate_from_prefix(built, tokens, n, p, out_tokens, n_out,
                                                           self.ffi.NULL))


# (id, prompt, generate's keyword arguments: the same names as in tl_gen_params)
GENERATE_CASES = [
    ("max_tokens", GOOD, dict(max_tokens=0)),
    ("loops", GOOD, dict(loops=P.MAX_LOOPS + 1)),
    ("temperature", GOOD, dict(temperature=-0.5)),
    ("temperature NaN", GOOD, dict(temperature=math.nan)),
    ("top_k", GOOD, dict(top_k=-1)),
    ("top_p", GOOD, dict(top_p=1.5)),
    ("repetition_penalty", GOOD, dict(repetition_penalty=-0.5)),
    ("empty stop sequence", GOOD, dict(stop_sequences=[[]])),
    ("stop token id", GOOD, dict(stop_sequences=[[1, 999]])),
    ("prompt token id", [1, 300], {}),
    ("longer than max_seq_len", [1] * 90, dict(max_tokens=7)),
]
# (id, (loops, cache_window) of a prefix of GOOD, suffix, generate_from_prefix_cache kwargs)
PREFIX_CASES = [
    ("loops mismatch", (2, 0), [], dict(loops=3)),
    ("cache_window mismatch", (2, 4), [], dict(cache_window=8)),
    ("suffix token id", (2, 0), [1000], {}),
]


@pytest.fixture(scope="module")
def c_model(model_files):
    require_backend("native")
    return CModel(model_files["int8-gqa"])


@pytest.mark.parametrize("prompt, kwargs", [c[1:] for c in GENERATE_CASES],
                         ids=[c[0] for c in GENERATE_CASES])
def test_generate_refuses_with_the_same_message(models, c_model, prompt, kwargs):
    with pytest.raises((ValueError, RuntimeError)) as python:
        models["int8-gqa"].generate(prompt, **kwargs)
    assert c_model.generate(prompt, **kwargs) == str(python.value)


@pytest.mark.parametrize("prefix, suffix, kwargs", [c[1:] for c in PREFIX_CASES],
                         ids=[c[0] for c in PREFIX_CASES])
def test_prefix_generation_refuses_with_the_same_message(models, c_model, prefix, suffix, kwargs):
    model = models["int8-gqa"]
    built = model.build_prefix_cache(GOOD, loops=prefix[0], cache_window=prefix[1])
    with pytest.raises((ValueError, RuntimeError)) as python:
        model.generate_from_prefix_cache(built, suffix=suffix, **kwargs)
    # each names its own way to build a prefix that can be deepened (docs/api.md, "Warm start")
    c_message = c_model.generate(suffix, prefix=prefix, **kwargs)
    assert c_message.replace("TL_PREFIX_WARM_START", "warm_start=True") == str(python.value)


def test_a_closed_model_says_so_in_both(model_files):
    require_backend("native")
    python = tinyloop.Model(model_files["int8-gqa"], backend="numpy")
    python.close()
    with pytest.raises(RuntimeError) as closed:
        python.generate(GOOD)
    c = CModel(model_files["int8-gqa"])
    c.lib.tl_model_close(c.handle)
    assert c.generate() == str(closed.value) == "model was closed"


def test_non_finite_logits_fail_alike(tmp_path, model_files):
    """A valid file whose embedding scale overflows: both backends refuse to sample (§5.1)."""
    require_backend("native")
    config, tensors = modelfile.load_model(model_files["int8-gqa"])
    tensors = {name: np.array(a) for name, a in tensors.items()}
    tensors["tok_emb.s"][5] = np.float32(3e38)                   # 127 * 3e38 overflows to inf
    path = tmp_path / "overflow.tinyloop"
    modelfile.save_model(path, config, tensors)
    messages = []
    for backend in ("numpy", "native"):
        with tinyloop.Model(path, backend=backend) as model, pytest.raises(RuntimeError) as info:
            with np.errstate(over="ignore", invalid="ignore"):
                model.generate([1, 5], max_tokens=2)
        messages.append(str(info.value))
    assert messages[0].startswith("non-finite logits"), messages
    assert messages[1].startswith(messages[0]), messages


def test_defaults_and_versions_are_the_same(c_model):
    c = c_model
    defaults = c.lib.tl_gen_params_default()
    python = inspect.signature(tinyloop.Model.generate).parameters
    for name in ("max_tokens", "temperature", "top_k", "top_p", "repetition_penalty",
                 "cache_window"):
        assert getattr(defaults, name) == python[name].default, name
    runtime = c.ffi.new("tl_model_runtime*", {"size": c.ffi.sizeof("tl_model_runtime")})
    assert c.lib.tl_model_runtime_get(c.handle, runtime) == c.lib.TL_OK
    block_size = inspect.signature(tinyloop.Model).parameters["block_size"].default
    assert runtime.kv_block_size == block_size
    assert c.ffi.string(c.lib.tl_version_string()).decode() == tinyloop.__version__


def test_isa_names_are_the_library_names(model_files):
    require_backend("native")
    names = set(re.findall(r'case TL_ISA_\w+: return "([\w-]+)"', c_source("cpu/isa.c")))
    enum = dict(re.findall(r"\bTL_ISA_(\w+) = (\d+)", HEADER.read_text()))
    assert native.ISAS == {int(value): name.lower().replace("_", "-")
                           for name, value in enum.items() if name != "AUTO"}
    assert set(native.ISAS.values()) <= names
    with tinyloop.Model(model_files["int8-gqa"], backend="native") as model:
        runtime = model.runtime()
    isa = runtime["isa"]            # the library's own name; "amx-emulated" in the test build
    assert runtime["device_name"] in (f"cpu ({isa})", f"cpu ({isa}-emulated)")
    features = tinyloop.backend_features
    labels = {f.removeprefix("native-") for f in features if f.startswith("native-")} - {"cuda"}
    assert labels <= names, labels
