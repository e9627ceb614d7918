"""The instruction block (prefix-LM, docs/spec.md §4.1: HRM-Text's token_type_ids) on every path
that runs a prompt: chunks of any size (§4.2), the automatic prefix cache and its disk tier
(§4.3, a tree per instruction length), prefixes, their blobs and warm start (§5.4), batches and the
scheduler (§5.5, the block in one chunk even past step_tokens). Each path gives the tokens and
logits of a plain numpy run of the same prompt, bit for bit, on every backend; a request of
another instruction length shares nothing. Then the errors a bad instruction_length gets.
tests/test_window.py holds the engine to a naive definition of the mask."""
import numpy as np
import pytest
from hypothesis import strategies as st

import tinyloop
from tinyloop.quickbench import backend_kwargs

from conftest import assert_same_bits, assert_same_generation, backend_given, run_retrying_failed_steps, simulated
from strategies import model_shapes, prompts

GENERATION = dict(max_tokens=4, return_logits=True)


def drawn_request(data, zoo, backend, **model_kwargs):
    """(shape, model on `backend`, prompt of >= 2 tokens, P in 1 .. len(prompt), depth)."""
    shape = data.draw(model_shapes(tiny=simulated(backend)), "shape")
    model = zoo.open(shape, backend, block_size=data.draw(st.sampled_from([1, 2, 3, 8])),
                     **model_kwargs)
    prompt = data.draw(prompts(shape["vocab_size"], min_size=2, max_size=20), "prompt")
    instruction = data.draw(st.integers(1, len(prompt)), "instruction")
    return shape, model, prompt, instruction, data.draw(st.integers(1, 3), "loops")


@backend_given(data=st.data())
def test_every_path_of_an_instruction_prompt_is_the_plain_run(backend, zoo, data):
    shape, model, prompt, P, loops = drawn_request(data, zoo, backend,
                                                   prefix_cache_bytes=1 << 22)
    with model, zoo.open(shape, "numpy") as reference:
        want = reference.generate(prompt, loops=loops, instruction_length=P, **GENERATION)
        chunk = data.draw(st.integers(1, len(prompt)), "chunk")
        for _ in range(2):                          # a miss, then a hit of the prefix cache
            got = model.generate(prompt, loops=loops, instruction_length=P,
                                 prefill_chunk=chunk, **GENERATION)
            assert_same_generation(got, want)
        split = data.draw(st.integers(P, len(prompt)), "split")
        prefix = model.build_prefix_cache(prompt[:split], loops=loops, instruction_length=P,
                                          prefill_chunk=chunk)
        assert prefix.instruction_length == P
        loaded = model.prefix_from_bytes(prefix.to_bytes())
        assert loaded.instruction_length == P and loaded.to_bytes() == prefix.to_bytes()
        for start in (prefix, loaded):
            got = model.generate_from_prefix_cache(start, suffix=prompt[split:], **GENERATION)
            assert_same_generation(got, want)
        batch = model.generate_batch([prompt, prompt], loops=loops, return_logits=True,
                                     max_tokens=4, per_request=[{"instruction_length": P}, {}])
        assert_same_generation(batch[0], want)
        assert_same_generation(batch[1], reference.generate(prompt, loops=loops, **GENERATION))


@backend_given(data=st.data())
def test_a_warm_start_prefix_extends_over_its_instruction_block(backend, zoo, data):
    shape, model, prompt, P, loops = drawn_request(data, zoo, backend)
    with model:
        shallow = model.build_prefix_cache(prompt, loops=1, instruction_length=P, warm_start=True)
        shallow.extend(loops + 1, prefill_chunk=data.draw(st.integers(1, len(prompt)), "chunk"))
        deep = model.build_prefix_cache(prompt, loops=loops + 1, instruction_length=P,
                                        warm_start=True)
        assert shallow.to_bytes() == deep.to_bytes()


@backend_given(data=st.data())
def test_the_scheduler_runs_the_block_whole_past_step_tokens(backend, zoo, data):
    shape, model, prompt, P, loops = drawn_request(data, zoo, backend,
                                                   prefix_cache_bytes=1 << 22)
    other = data.draw(prompts(shape["vocab_size"], max_size=8), "other")
    with model, tinyloop.Scheduler(model, max_batch=2, step_tokens=2) as scheduler:
        ids = [scheduler.add(prompt, loops=loops, instruction_length=P, max_tokens=4),
               scheduler.add(other, loops=loops, max_tokens=4)]
        got, _ = run_retrying_failed_steps(scheduler, ids)
        assert got[ids[0]] == model.generate(prompt, loops=loops, instruction_length=P,
                                             max_tokens=4)[len(prompt):]
        assert got[ids[1]] == model.generate(other, loops=loops, max_tokens=4)[len(other):]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("instruction") / "m.tinyloop"
    tinyloop.random_model(path, seed=3, vocab_size=64, d_model=16, n_heads=2, n_kv_heads=1,
                          head_dim=8, ffn_dim=16, default_loops=2, max_seq_len=96)
    return path


@pytest.mark.parametrize("instruction", [2, 7, 12])
def test_instruction_logits_match_numpy(backend, model_path, instruction):
    """A fixed case beside the drawn ones (few on numba's CUDA simulator): every position's
    logits, chunked so the block grows the first chunk, are numpy's; the block changes them."""
    prompt = [5, 9, 1, 33, 7, 2, 60, 14, 3, 3, 41, 8, 19, 27]
    with tinyloop.Model(model_path, backend="numpy") as reference:
        want = reference.logits(prompt, instruction_length=instruction)
        assert not np.array_equal(want, reference.logits(prompt))
    with tinyloop.Model(model_path, **backend_kwargs(backend)) as model:
        assert_same_bits(model.logits(prompt, instruction_length=instruction, prefill_chunk=3),
                         want)


def test_requests_share_blocks_only_with_their_instruction_length(backend, model_path, tmp_path):
    prompt = list(range(1, 40))
    kwargs = dict(prefix_cache_bytes=1 << 22, block_size=4, prefix_cache_dir=str(tmp_path))
    with tinyloop.Model(model_path, backend="numpy") as reference:
        want = {P: reference.generate(prompt, instruction_length=P, **GENERATION)
                for P in (0, 10)}
    with tinyloop.Model(model_path, **backend_kwargs(backend),
                        **kwargs) as model:
        assert_same_generation(model.generate(prompt, instruction_length=10, **GENERATION),
                               want[10])
        for P in (0, 9, 11):          # another tree: nothing shared, nothing read from disk
            before = model.cache_stats()["hit_tokens"]
            model.generate(prompt, instruction_length=P, max_tokens=1)
            assert model.cache_stats()["hit_tokens"] == before
        changed = prompt[:6] + [0] + prompt[7:]      # differs inside the block: k*bs < P
        model.generate(changed, instruction_length=10, max_tokens=1)
        assert model.cache_stats()["hit_tokens"] == before
        assert_same_generation(model.generate(prompt, instruction_length=10, **GENERATION),
                               want[10])
        assert model.cache_stats()["hit_tokens"] == before + 36
    with tinyloop.Model(model_path, **backend_kwargs(backend),
                        **kwargs) as warm:        # from the disk tier the close spilled
        for P in (10, 0):
            assert_same_generation(warm.generate(prompt, instruction_length=P, **GENERATION),
                                   want[P])
        assert warm.cache_stats()["disk_hit_blocks"] == 2 * 9


def test_a_bad_instruction_length_is_refused(backend, model_path):
    with tinyloop.Model(model_path, **backend_kwargs(backend)) as model:
        with pytest.raises(ValueError, match="instruction_length 4 exceeds the prompt's 3"):
            model.generate([1, 2, 3], instruction_length=4)
        with pytest.raises(ValueError, match="instruction_length 4 exceeds the prompt's 3"):
            model.logits([1, 2, 3], instruction_length=4)
        with pytest.raises(ValueError, match="instruction_length 4 exceeds the prompt's 3"):
            model.build_prefix_cache([1, 2, 3], instruction_length=4)
        with pytest.raises(ValueError, match="instruction_length"):
            model.generate([1, 2, 3], instruction_length=-1)
        prefix = model.build_prefix_cache([1, 2, 3], instruction_length=2)
        with pytest.raises(ValueError, match="takes the prefix's \\(2\\)"):
            model.generate_batch([[4]], prefix=prefix, instruction_length=1)
        assert len(model.generate([1, 2, 3], instruction_length=3, max_tokens=2)) == 5
        assert np.array_equal(model.logits([1, 2, 3], instruction_length=1),
                              model.logits([1, 2, 3]))    # a block of one token is causal
