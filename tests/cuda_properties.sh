#!/usr/bin/env bash
# The Python properties that reach every kernel and branch of libtinyloop's CUDA backend, on
# backend "native-cuda" against numpy, bit for bit: cross-backend (drawn version-1 and version-2
# shapes), batches of mixed depths, windows, chunk sizes, prefix splits, the int4 KV mode,
# hidden-state prefixes, speculative decoding, warm start, the scheduler with its mixed pass and
# the instruction block and loop attention
# (every native model of those suites on the device: TINYLOOP_DEVICE=cuda). The same selection runs on the emulated
# device in CI (libtinyloop/run_cuda_emulation.sh) and on a real GPU first in bench/gpu_check.sh.
#
#     bash tests/cuda_properties.sh [PYTEST ARGS...]     # from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
properties=(test_cross_backend
            test_each_request_gets_what_it_gets_alone test_continuations_of_one_prefix
            test_windowed_engine_equals_naive_definition test_every_chunk_size_gives_identical_logits
            test_prefix_split_anywhere_gives_the_same_continuation
            test_int4_logits_match_numpy test_int4_prefixes_batches_and_drafts_match_numpy
            test_h8_prefixes_generate_exactly_what_kv_prefixes_and_generate_do
            test_threads_generating_from_one_h_prefix
            test_speculative_generation_is_plain_generation test_an_extended_prefix_is_a_prefix_built_at_its
            test_every_request_gets_what_it_gets_alone test_the_mixed_pass_emits_what_separate_passes_emit
            test_instruction_block_equals_naive_definition test_instruction_logits_match_numpy
            test_every_path_of_an_instruction_prompt_is_the_plain_run
            test_loop_attention_equals_naive_definition
            test_loop_attention_local_branch_keeps_the_narrower_window)
selected=$(printf ' or %s' "${properties[@]}")
TINYLOOP_TEST_BACKENDS=native-cuda TINYLOOP_REQUIRE_BACKENDS=native-cuda TINYLOOP_DEVICE=cuda \
  python3 -m pytest -q -p no:cacheprovider -k "${selected# or }" "$@" tests/test_cross_backend.py \
  tests/test_batch.py tests/test_window.py tests/test_paths.py tests/test_kv_int4.py tests/test_hidden_prefix.py \
  tests/test_speculative.py tests/test_warm_start.py tests/test_scheduler.py tests/test_instruction_block.py
