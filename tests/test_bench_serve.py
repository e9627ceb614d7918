"""bench/bench_serve.py's load generator without any server: the Zipf choice of system prompts,
the workload's prompts, the percentiles, server-sent-event parsing, a level's summary, and one
streamed request read from a canned reply (httpx's mock transport)."""
import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_serve as bench  # noqa: E402


def test_zipf_weights_fall_as_a_power_of_the_rank():
    weights = bench.zipf_weights(4, 1.5)
    assert weights.sum() == pytest.approx(1.0)
    assert weights[0] / weights[1:] == pytest.approx([2 ** 1.5, 3 ** 1.5, 4 ** 1.5])
    assert np.all(bench.zipf_weights(3, 0.0) == 1 / 3)


def test_the_workload_draws_system_prompts_by_zipf_and_appends_a_question():
    systems = [[300 + k] * (10 * (k + 1)) for k in range(3)]
    n, vocab = 6000, 1000
    requests = bench.make_workload(n, systems, 1.0, vocab, np.random.default_rng(5))
    counts = np.bincount([r.system for r in requests], minlength=3)
    # 6000 draws: each share within 3 standard deviations of its Zipf probability
    p = bench.zipf_weights(3, 1.0)
    assert np.all(np.abs(counts / n - p) < 3 * np.sqrt(p * (1 - p) / n))
    for r in requests[:200]:
        system = systems[r.system]
        question = r.prompt[len(system):]
        assert r.prompt[:len(system)] == system
        assert bench.QUESTION_TOKENS[0] <= len(question) <= bench.QUESTION_TOKENS[1]
        assert all(bench.FIRST_SHARED_ID <= t < vocab for t in question)
    again = bench.make_workload(n, systems, 1.0, vocab, np.random.default_rng(5))
    assert again == requests                    # one seed, one workload, for every engine


def test_percentiles_interpolate_between_ranks():
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert bench.percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert bench.percentile([7.0], 99) == 7.0
    assert bench.percentile([], 50) is None


def test_sse_lines_give_their_json_then_done():
    chunk = {"choices": [{"text": " t300", "index": 0}]}
    assert bench.sse_data(f"data: {json.dumps(chunk)}") == chunk
    assert bench.sse_data(f"data:{json.dumps(chunk)}") == chunk   # the space is optional
    assert bench.sse_data("data: [DONE]") is bench.DONE
    for other in ("", ": keep-alive", "event: completion", "id: 3"):
        assert bench.sse_data(other) is None
    with pytest.raises(RuntimeError, match="context length"):
        bench.sse_data('data: {"error": {"message": "context length exceeded"}}')


def test_a_levels_summary():
    results = [bench.Result(0, 10.0, [10.5, 10.6, 10.8], 3),
               bench.Result(1, 11.0, [11.1, 11.3, 11.4], 3)]
    row = bench.summarize(results, 2.0, longest=0)
    assert row["tokens"] == 6 and row["tok/s"] == 3.0
    assert row["TTFT p50 ms"] == pytest.approx(300.0)              # of 500 and 100 ms
    assert row["2k TTFT p99 ms"] == pytest.approx(500.0)           # request 0 alone
    assert row["ITL p50 ms"] == pytest.approx(150.0)               # gaps 100 200 200 100
    assert row["ITL p99 ms"] == pytest.approx(200.0)
    assert row["chunks/token"] == 1.0


class CannedServer:
    name, model_id, url, extra_body = "canned", "m", "http://canned", {"ignore_eos": True}


def canned_stream(texts, completion_tokens):
    """An httpx client whose /v1/completions streams `texts`, then usage and [DONE]."""
    seen = []

    def reply(request):
        seen.append(json.loads(request.content))
        events = [{"choices": [{"text": t, "index": 0}]} for t in texts]
        events.append({"choices": [], "usage": {"completion_tokens": completion_tokens}})
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return bench.httpx.Response(200, text=body,
                                    headers={"content-type": "text/event-stream"})

    return bench.httpx.AsyncClient(transport=bench.httpx.MockTransport(reply)), seen


def stream(client, max_tokens):
    async def go():
        async with client:
            return await bench.stream_one(client, CannedServer(), bench.Request(2, [300, 301]),
                                          max_tokens)
    return asyncio.run(go())


def test_a_streamed_request_records_its_chunks_and_tokens():
    pytest.importorskip("httpx")
    client, seen = canned_stream([" t1", "", " t2", " t3"], 3)
    result = stream(client, 3)
    assert (result.system, result.tokens, len(result.chunks)) == (2, 3, 3)   # "" is no chunk
    assert result.sent <= result.chunks[0] <= result.chunks[-1]
    assert seen == [{"model": "m", "prompt": [300, 301], "max_tokens": 3, "temperature": 0.0,
                     "stream": True, "stream_options": {"include_usage": True},
                     "ignore_eos": True}]


def test_a_reply_of_another_length_fails_the_bench():
    pytest.importorskip("httpx")
    client, _ = canned_stream([" t1", " t2"], 2)
    with pytest.raises(RuntimeError, match="streamed 2 tokens in 2 chunks; the bench needs "
                                           "exactly 3"):
        stream(client, 3)


def test_the_goals_are_judged_on_tinyloops_rows():
    def row(engine, clients, ratio, cached_ms):
        return {"engine": engine, "clients": clients, "tok/s ratio": ratio,
                "2k TTFT p99 ms": cached_ms}

    rows = [row("tinyloop serve", 1, 1.5, 200.0), row("llama-server", 1, None, 150.0),
            row("tinyloop serve", 32, 2.5, 1400.0), row("llama-server", 32, None, 900.0)]
    assert bench.goals(rows, "quick", "llama-server") == (
        "Goal >= 2x llama-server's tok/s at 32 clients: 2.50x, met. Goal TTFT p99 < 1 s on the "
        "cached 2k system prompt: met at 1 client level(s) of 1, 32.")
    rows[2]["tok/s ratio"] = 1.9
    assert "vLLM's tok/s at 32 clients: 1.90x, not met" in bench.goals(rows, "quick", "vLLM")
    assert "TTFT" not in bench.goals(rows, "full", "vLLM")
