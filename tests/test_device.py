"""Device selection: Model(device=...), TINYLOOP_DEVICE, backend_info and the C library's
tl_device_check. On a machine without a usable GPU, asking for CUDA fails with the library's
reason and never falls back silently; "auto" runs on the CPU (CUDA stays out of "auto" until it
is verified on a GPU). The CUDA results themselves are checked bit for bit by
test_cross_backend.py's "native-cuda" backend."""
import pytest

import tinyloop
from tinyloop.backends import cuda_device_status

from conftest import same_bits

pytestmark = pytest.mark.usefixtures("require_native")


def test_auto_and_cpu_run_on_the_cpu(small_model, model_files):
    prompt = [1, 2, 3, 4, 5]
    want = small_model.logits(prompt)
    for device in ("auto", "cpu"):
        with tinyloop.Model(model_files["int8-gqa"], backend="native", device=device) as m:
            runtime = m.runtime()
            assert m.device == "cpu" and runtime["device"] == "cpu"
            assert runtime["device_name"].startswith("cpu (") and runtime["device_weight_bytes"] == 0
            assert same_bits(m.logits(prompt), want)


def test_unknown_device_is_refused(model_files):
    with pytest.raises(ValueError, match="device 'gpu' is not one of auto, cpu, cuda"):
        tinyloop.Model(model_files["int8-gqa"], device="gpu")


def test_cuda_needs_the_native_backend(model_files):
    with pytest.raises(ValueError, match="device='cuda' runs on the native backend, not 'numpy'"):
        tinyloop.Model(model_files["int8-gqa"], backend="numpy", device="cuda")


def test_cuda_without_a_gpu_says_why(model_files):
    ok, why = cuda_device_status()
    if ok:
        pytest.skip("a CUDA device is available here (test_cross_backend.py checks it)")
    assert why.startswith(("libtinyloop was built without CUDA", "no CUDA device"))
    with pytest.raises(RuntimeError) as caught:
        tinyloop.Model(model_files["int8-gqa"], device="cuda")
    assert str(caught.value) == why
    info = tinyloop.backend_info("auto", "cuda")
    assert info["cuda_available"] is False and info["cuda_reason"] == why
    assert "native-cuda" not in tinyloop.backend_features


def test_tinyloop_device_steers_native_models_only(model_files, monkeypatch):
    monkeypatch.setenv("TINYLOOP_DEVICE", "cpu")
    with tinyloop.Model(model_files["int8-gqa"], backend="native") as m:
        assert m.device == "cpu"
    monkeypatch.setenv("TINYLOOP_DEVICE", "cuda")
    with tinyloop.Model(model_files["int8-gqa"], backend="numpy") as m:   # not steered
        assert m.device == "cpu"
    if not cuda_device_status()[0]:
        with pytest.raises(RuntimeError, match="CUDA"):
            tinyloop.Model(model_files["int8-gqa"], backend="native")
    monkeypatch.setenv("TINYLOOP_DEVICE", "tpu")
    with pytest.raises(ValueError, match="TINYLOOP_DEVICE='tpu' is not one of"):
        tinyloop.Model(model_files["int8-gqa"])


def test_backend_info_reports_the_device():
    info = tinyloop.backend_info("native", "cpu")
    assert info["device"] == "cpu"
    assert isinstance(info["cuda_available"], bool) and isinstance(info["cuda_reason"], str)
    with pytest.raises(ValueError, match="device 'npu'"):
        tinyloop.backend_info("auto", "npu")
