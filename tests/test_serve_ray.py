"""tinyloop.serve.ray on a local Ray instance bound to 127.0.0.1: two replicas of the demo model
behind prefix-affinity routing, then behind round robin, on the same workload of requests over a
few shared prefixes. Affinity must take strictly more prompt tokens from the replicas' prefix
caches, and every reply, on either, must be Model.generate's for the same arguments. The
round-robin application also gets the HTTP ingress, checked with raw HTTP on a free port.

Skipped only when Ray is not installed (the `ray` extra); CI installs it.
"""
import asyncio
import json
import socket
import urllib.error
import urllib.request

import numpy as np
import pytest
from hypothesis import given, strategies as st

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

import tinyloop  # noqa: E402
from tinyloop.serve.ray import block_keys, deploy  # noqa: E402

# Three shared prefixes (system prompts) of 5-6 KV blocks of 16 byte tokens, and per-request
# questions. Each round sends one request per prefix at once, so no two requests that share a
# prefix race on it, in an order rotated by one each round (so that placing requests by their
# place in a round, as a least-loaded policy does, moves the prefixes); round robin sends every
# prefix to both replicas (3 requests a round on 2 replicas), affinity to one.
PREFIXES = [
    "You are a scribe of the King James Bible. Answer in its English, plainly and briefly. ",
    "And God said, Let there be light: and there was light. And God saw the light, that it "
    "was good. ",
    "In the beginning was the Word, and the Word was with God, and the Word was God. Reply so. ",
]
ROUNDS = 4
SAMPLING = dict(max_tokens=6, temperature=0.8, top_k=40, top_p=0.95)
PREFIX_CACHE_BYTES = 8 << 20      # small, but holds every prefix on one replica
BURST = 6                         # requests sharing one prefix at once, 2 per replica at most
REPLY_TIMEOUT_S = 60


def workload():
    """[(prompt ids, Scheduler.add keyword arguments)] in the order of their rounds."""
    requests = []
    for r in range(ROUNDS):
        for i in range(len(PREFIXES)):
            p = (r + i) % len(PREFIXES)
            prompt = list(f"{PREFIXES[p]}Question {r}: who said it?\n".encode())
            requests.append((prompt, dict(SAMPLING, seed=100 * r + p)))
    return requests


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=100 << 20, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def offline():
    with tinyloop.Model(prefix_cache_bytes=0, threads=1) as model:
        yield model


def generate_all(handle, requests):
    """The emitted tokens of each (prompt ids, kwargs) of `requests`, all sent at once (within
    REPLY_TIMEOUT_S: a replica that hangs fails the test)."""
    stream = handle.options(stream=True)

    async def tokens(prompt, kwargs):
        return [token async for token, _ in stream.generate.remote(prompt, **kwargs)]

    async def everything():
        return await asyncio.wait_for(asyncio.gather(*(tokens(*r) for r in requests)),
                                      REPLY_TIMEOUT_S)
    return asyncio.run(everything())


def run_workload(routing, **options):
    """Deploy two replicas with `routing` and run the workload round by round; returns (the
    handle, the emitted tokens of each request, every replica's cache_stats())."""
    handle = deploy(None, num_replicas=2, routing=routing, name=routing,
                    model_options=dict(threads=1, prefix_cache_bytes=PREFIX_CACHE_BYTES),
                    engine_options=dict(max_batch=8, step_tokens=256), **options)
    replies, requests = [], workload()
    for start in range(0, len(requests), len(PREFIXES)):
        replies += generate_all(handle, requests[start:start + len(PREFIXES)])
    return handle, replies, handle.broadcast("cache_stats").results(timeout_s=REPLY_TIMEOUT_S)


def burst():
    """BURST requests on one prefix: more than its replica takes at once."""
    return [(list(f"{PREFIXES[0]}Burst {i}: and it came to pass".encode()),
             dict(SAMPLING, max_tokens=32, seed=7 + i)) for i in range(BURST)]


@pytest.fixture(scope="module")
def outcomes(cluster):
    # a replica of the affinity application takes 2 requests at once (each round sends at most
    # 2 to one replica), so the burst overflows the prefix's replica
    handle, *affinity = run_workload("prefix", max_ongoing_requests=2)
    overflow = generate_all(handle, burst())
    serve.delete("prefix")
    round_robin = run_workload("round_robin", route_prefix="/")[1:]
    return {"prefix": affinity, "round_robin": round_robin, "burst": overflow}


@given(shared=st.lists(st.integers(0, 255), max_size=80),
       tails=st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=40), min_size=2,
                      max_size=2),
       salts=st.sampled_from([("", ""), ("a", "a"), ("a", "b")]))
def test_block_keys_are_equal_exactly_for_shared_blocks(shared, tails, salts):
    """Two prompts get equal keys for the full blocks they share, and no others; a different
    cache salt shares none."""
    prompts = [np.array(shared + tail, np.int32) for tail in tails]
    keys = [block_keys(b"ids", p.astype("<i4").tobytes(), salt, 16)
            for p, salt in zip(prompts, salts)]
    for p, k in zip(prompts, keys):
        assert len(k) == len(p) // 4
    n = min(map(len, prompts))
    common = next((i for i in range(n) if prompts[0][i] != prompts[1][i]), n)
    same = 0 if salts[0] != salts[1] else common // 4
    assert keys[0][:same] == keys[1][:same]
    assert not set(keys[0][same:]) & set(keys[1])


def hit_rate(stats):
    prompt_tokens = sum(len(prompt) for prompt, _ in workload())
    return sum(s["hit_tokens"] for s in stats) / prompt_tokens


@pytest.mark.parametrize("routing", ["prefix", "round_robin"])
def test_replies_equal_offline_generate(outcomes, offline, routing):
    replies, stats = outcomes[routing]
    assert len(stats) == 2                  # both replicas answered the broadcast
    assert len(replies) == len(workload())
    for (prompt, kwargs), got in zip(workload(), replies):
        want = offline.generate(prompt, **kwargs)[len(prompt):]
        assert got == list(want), (routing, kwargs)


def test_overflow_goes_elsewhere_and_completes(outcomes, offline):
    """A burst beyond what the prefix's replica takes at once waits or spills over to the other
    replica; every request completes with Model.generate's tokens."""
    for (prompt, kwargs), got in zip(burst(), outcomes["burst"]):
        assert got == list(offline.generate(prompt, **kwargs)[len(prompt):])
    assert len(outcomes["burst"]) == BURST


def test_affinity_reuses_more_of_the_prefix_caches(outcomes):
    affinity, round_robin = (hit_rate(outcomes[r][1]) for r in ("prefix", "round_robin"))
    print(f"prefix hit rate: affinity {affinity:.3f}, round robin {round_robin:.3f}")
    assert affinity > round_robin > 0


def post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_openai_completions_over_http(cluster, outcomes, offline):
    prompt = PREFIXES[1] + "And he said"
    body = dict(model="tinyloop-demo", prompt=prompt, max_tokens=8, temperature=0.7, seed=5)
    ids = list(prompt.encode())
    emitted = offline.generate(ids, max_tokens=8, temperature=0.7, top_k=0, seed=5)[len(ids):]
    want = offline.decode(list(emitted), skip_special_tokens=True)

    status, text = post(f"{cluster}/v1/completions", body)
    assert status == 200, text
    reply = json.loads(text)
    assert reply["choices"][0]["text"] == want
    assert reply["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 8,
                              "total_tokens": len(ids) + 8}

    status, text = post(f"{cluster}/v1/completions", dict(body, stream=True))
    assert status == 200, text
    lines = [line[len("data: "):] for line in text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    assert "".join(json.loads(chunk)["choices"][0]["text"] for chunk in lines[:-1]) == want

    status, text = post(f"{cluster}/v1/completions", dict(body, temperature="hot"))
    assert status == 400, text
    assert json.loads(text)["error"]["param"] == "temperature"

    status, text = post(f"{cluster}/v1/nothing", body)
    assert status == 404 and json.loads(text)["error"]["code"] == "unknown_url", text

    with urllib.request.urlopen(f"{cluster}/v1/models", timeout=REPLY_TIMEOUT_S) as response:
        assert [m["id"] for m in json.loads(response.read())["data"]] == ["tinyloop-demo"]
