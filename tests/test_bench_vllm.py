"""The vLLM peer's parts that run without vLLM (bench/vllm_peer.py, bench_vllm.py, bench_serve.py's
vLLM engines): bf16 rounding as torch rounds, the random LLaMA folder as transformers' own
LlamaForCausalLM reads it and as TinyLoop converts it (the same network for every engine), the
streamed-versus-offline token check, and the errors for a missing or wrong vLLM install."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tinyloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_serve  # noqa: E402
import bench_vllm  # noqa: E402
import vllm_peer  # noqa: E402


def test_bf16_rounding_is_torchs():
    rng = np.random.default_rng(3)
    values = np.concatenate([
        rng.standard_normal(4096).astype(np.float32) * 0.02,
        rng.standard_normal(1024).astype(np.float32) * 1e30,
        np.array([0.0, -0.0, 1.0, -1.0, 65504.0, 1e-40, -1e-40, 3.4e38], np.float32),
        # halfway cases: the 16 dropped bits are exactly 0x8000 (ties go to the even bf16)
        np.array([0x3F808000, 0x3F818000, 0xBF808000], np.uint32).view(np.float32)])
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(vllm_peer.bf16_bits(values), theirs)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("peer")
    folder = vllm_peer.hf_llama("quick", directory)
    return folder, vllm_peer.tinyloop_llama(folder, "int8", directory)


def test_every_engine_gets_the_same_llama(llama):
    """transformers reads the folder as the shape's LLaMA with the drawn bf16 weights, and
    TinyLoop's int8 conversion of it computes the same function (int8 tolerance)."""
    from transformers import LlamaForCausalLM
    folder, ours = llama
    shape = bench_vllm.SHAPES["quick"]
    reference = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = reference.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.vocab_size) == (shape["d_model"], shape["ffn_dim"],
                                   shape["n_pre_blocks"] + shape["default_loops"],
                                   shape["vocab_size"])
    drawn = vllm_peer.llama_tensors("quick", seed=0)["model.layers.3.mlp.up_proj.weight"]
    stored = reference.model.layers[3].mlp.up_proj.weight.detach().numpy()
    assert np.array_equal(stored, torch.from_numpy(drawn).to(torch.bfloat16).float().numpy())

    prompt = np.random.default_rng(1).integers(bench_serve.FIRST_SHARED_ID, 32000, 24).tolist()
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0].numpy()
    with tinyloop.Model(ours, backend="native", threads=1) as model:
        assert model.config()["eos_id"] == -1          # nothing can end a bench reply early
        mine = model.logits(prompt)
    cosine = (mine * theirs).sum(-1) / np.linalg.norm(mine, axis=-1) / np.linalg.norm(theirs,
                                                                                       axis=-1)
    assert cosine.min() > 0.99, cosine


def test_streamed_replies_are_held_to_offline_generate(llama):
    _, ours = llama
    prompt = list(range(300, 340))
    with tinyloop.Model(ours, backend="native", threads=1) as model:
        emitted = model.generate(prompt, max_tokens=5)[len(prompt):]
        text = model.decode(emitted)
    same = bench_serve.Result(0, 0.0, [0.1] * 5, 5, text=" " + text, prompt=prompt)
    assert bench_serve.check_tokens(ours, [same, same], threads=1) == 2
    other = bench_serve.Result(0, 0.0, [0.1] * 5, 5, text=text.rsplit(" ", 1)[0] + " t9",
                               prompt=prompt)
    with pytest.raises(RuntimeError, match="offline generate gives"):
        bench_serve.check_tokens(ours, [same, other], threads=1)


def test_a_folder_that_is_no_vllm_install_is_named(tmp_path):
    with pytest.raises(SystemExit, match=r"venv/bin/python.*env\.sh.*bench/vllm_setup\.sh"):
        vllm_peer.VllmInstall(tmp_path)
    with pytest.raises(SystemExit, match="vllm_setup.sh"):
        bench_vllm.main(["--vllm-dir", str(tmp_path)])


def test_the_benches_refuse_bad_engine_options(capsys):
    with pytest.raises(SystemExit):
        bench_serve.main(["--engines", "tinyloop,vllm"])
    assert "needs --vllm-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_serve.main(["--engines", "tinyloop,vllm-fp8"])
    assert "vllm-w8a8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_vllm.main(["--vllm-dir", ".", "--dtypes", "fp8"])
    assert "the dtypes are bf16 and w8a8" in capsys.readouterr().err
