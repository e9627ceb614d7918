"""`tinyloop serve` (tinyloop.serve) over HTTP with the official `openai` client and raw httpx.

Servers run in this process on 127.0.0.1, each on a free port of its own, on a uvicorn thread
that stops at the end of the module. The replies are checked against offline `Model.generate`
with the same prompt ids and seed on a model opened separately: a request's tokens are the same
whatever else the server runs (32 concurrent streams; a burst beyond the KV budget, which
preempts), and with self-speculative decoding (draft_loops, n_draft) they are plain decoding's.
The bundled demo model (bytes tokenizer: one token per byte, so equal text is equal tokens)
serves the completions; a tiny random model with a Hugging Face tokenizer and a chat
template (tests/tiny_hf.py) serves the chats.
"""
import asyncio
import contextlib
import json
import socket
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
parser = pytest.importorskip("prometheus_client.parser")

import tinyloop                                               # noqa: E402
from tinyloop.cli import main                                 # noqa: E402
from tinyloop.serve import EngineLoop, create_app             # noqa: E402
from tinyloop.serve.handler import StopText                   # noqa: E402
from tinyloop.tokenizer import end_of_turn_stops              # noqa: E402
from serve_process import START_TIMEOUT, healthy, serve_process  # noqa: E402
from tiny_hf import hf_model                                  # noqa: E402

DEMO = "tinyloop-demo"
ENGINE_TIMEOUT = 60         # seconds an EngineLoop test may run (a dead engine thread hangs)
SLOW_LOOPS = 64             # a depth that makes a long reply take seconds: time to cancel it
PROMPTS = ["And God said", "In the beginning", "Blessed are they", "And Jesus answered",
           "Thus saith the LORD", "And it came to pass", "Let there be", "The LORD is"]


@contextlib.contextmanager
def running(app):
    """`app` served by uvicorn on a thread, on a free loopback port: yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


@contextlib.contextmanager
def serving(model=None, **options):
    """A server of `model` (create_app's arguments), once its model has loaded."""
    with running(create_app(model, **options)) as url:
        deadline = time.monotonic() + START_TIMEOUT
        while not healthy(url):
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.05)
        yield url


@pytest.fixture(scope="module")
def reference():
    """The demo model, opened apart from the servers, for offline generate."""
    with tinyloop.Model(prefix_cache_bytes=0) as model:
        yield model


@pytest.fixture(scope="module")
def demo():
    with serving(max_batch=32, step_tokens=256) as url:
        yield url


@pytest.fixture(scope="module")
def client(demo):
    return openai.OpenAI(base_url=demo + "/v1", api_key="unused", max_retries=0, timeout=60)


def offline(model, prompt, max_tokens, seed, temperature=1.0, **kwargs):
    """The text and token count of Model.generate's reply with the server's defaults (OpenAI's:
    temperature 1, top_p 1, no top-k)."""
    ids = model.encode(prompt) if isinstance(prompt, str) else list(prompt)
    out = model.generate(ids, max_tokens=max_tokens, seed=seed, temperature=temperature,
                         top_k=kwargs.pop("top_k", 0), **kwargs)[len(ids):]
    text = model.decode(out, skip_special_tokens=True)
    if model.config()["tokenizer"] == "bytes":   # the text is the ids: equal text, equal tokens
        assert model.encode(text) == out, "the reply is not valid UTF-8; pick another seed"
    return text, len(out)


def metrics(url):
    """{sample name with labels: value} of GET /metrics, parsed by prometheus_client."""
    text = httpx.get(url + "/metrics").text
    return {name + (json.dumps(labels, sort_keys=True) if labels else ""): value
            for family in parser.text_string_to_metric_families(text)
            for name, labels, value, *_ in family.samples}


def finished(reason):
    return f'tinyloop_requests_total{{"finish_reason": "{reason}"}}'


def idle(values):
    """The engine runs nothing and has nothing waiting."""
    return values["tinyloop_requests_running"] == values["tinyloop_requests_waiting"] == 0


def wait_for(url, condition, timeout=20):
    """The metrics once condition(metrics) holds (the engine thread updates them)."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(url)
        if condition(values):
            return values
        assert time.monotonic() < deadline, f"metrics never satisfied the condition: {values}"
        time.sleep(0.05)


# -- completions -----------------------------------------------------------------------------
def test_models_and_health(demo, client):
    assert [m.id for m in client.models.list().data] == [DEMO]
    assert httpx.get(demo + "/health").json() == {"status": "ok"}


SAMPLINGS = [dict(temperature=1.0), dict(temperature=0.0),
             dict(temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.3, loops=3),
             dict(temperature=0.0, instruction_length=5)]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_completion_equals_offline_generate(client, reference, sampling):
    check_completion(client, reference, sampling)


def check_completion(client, reference, sampling):
    """A completion with `sampling` (TinyLoop's fields go in extra_body) is generate's."""
    openai_fields = {k: v for k, v in sampling.items() if k in ("temperature", "top_p")}
    extra = {k: v for k, v in sampling.items() if k not in openai_fields}
    reply = client.completions.create(model=DEMO, prompt=PROMPTS[0], max_tokens=24, seed=11,
                                      **openai_fields, extra_body=extra)
    text, n = offline(reference, PROMPTS[0], 24, 11, **sampling)
    assert reply.choices[0].text == text and n == 24
    assert reply.choices[0].finish_reason == "length"
    assert reply.object == "text_completion" and reply.model == DEMO
    prompt_tokens = len(reference.encode(PROMPTS[0]))
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens,
            reply.usage.total_tokens) == (prompt_tokens, 24, prompt_tokens + 24)


SPECULATIVE = {"draft_loops": 1, "n_draft": 4}


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_speculative_completion_equals_plain_generate_and_counts_its_drafts(demo, client,
                                                                             reference, sampling):
    """draft_loops / n_draft change no token of the reply; /metrics counts the request's drafted
    and accepted tokens, as offline generate counts them (it runs alone: no round is capped)."""
    openai_fields = {k: v for k, v in sampling.items() if k in ("temperature", "top_p")}
    extra = {k: v for k, v in sampling.items() if k not in openai_fields}
    before = wait_for(demo, idle)
    reply = client.completions.create(model=DEMO, prompt=PROMPTS[7], max_tokens=24, seed=13,
                                      **openai_fields, extra_body=dict(extra, **SPECULATIVE))
    assert reply.choices[0].text == offline(reference, PROMPTS[7], 24, 13, **sampling)[0]
    assert reply.usage.completion_tokens == 24
    drafts = {}
    offline(reference, PROMPTS[7], 24, 13, **sampling, **SPECULATIVE, draft_stats=drafts)
    after = wait_for(demo, idle)
    drafted, accepted = (after[name] - before[name] for name in (
        "tinyloop_draft_tokens_total", "tinyloop_draft_accepted_tokens_total"))
    assert (drafted, accepted) == (drafts["drafted"], drafts["accepted"])
    assert drafted > 0 and (accepted > 0 or sampling["temperature"] > 0)


@pytest.mark.parametrize("rule", [dict(exit_rule="latent", exit_threshold=0.3),
                                  dict(exit_rule="kl", exit_threshold=0.05, min_loops=2),
                                  dict(exit_rule="argmax", exit_threshold=1)])
def test_adaptive_completion_equals_offline_generate_and_counts_its_loops(demo, client, reference,
                                                                           rule):
    """exit_rule / exit_threshold / min_loops give the reply offline generate gives with them,
    and /metrics counts its decode passes and their loops as offline depth_stats does."""
    before = wait_for(demo, idle)
    reply = client.completions.create(model=DEMO, prompt=PROMPTS[5], max_tokens=20, seed=7,
                                      temperature=0.0, extra_body=rule)
    depths = {}
    assert reply.choices[0].text == offline(reference, PROMPTS[5], 20, 7, temperature=0.0,
                                            depth_stats=depths, **rule)[0]
    after = wait_for(demo, idle)
    passes, loops = (after[name] - before[name] for name in (
        "tinyloop_decode_passes_total", "tinyloop_decode_loops_total"))
    assert (passes, loops) == (depths["tokens"], depths["loops"])
    assert loops < 6 * passes                      # the rule stopped some tokens early
    histogram = "tinyloop_decode_loops_per_token"
    assert after[histogram + "_sum"] == after["tinyloop_decode_loops_total"]
    assert after[histogram + "_count"] == after["tinyloop_decode_passes_total"]
    # a bucket per depth up to the deepest pass seen so far (by this test or an earlier one)
    deepest = max(u for u in range(1, 7) if f'{histogram}_bucket{{"le": "{u}.0"}}' in after)
    buckets = [after[f'{histogram}_bucket{{"le": "{u}.0"}}'] for u in range(1, deepest + 1)]
    assert buckets == sorted(buckets) and buckets[-1] == after[histogram + "_count"]
    assert buckets[0] < buckets[-1]                # passes of several depths


def test_an_instruction_block_of_the_whole_prompt(client, reference):
    """instruction_length "prompt": the prompt is one instruction block (prefix-LM models)."""
    ids = reference.encode(PROMPTS[4])
    reply = client.completions.create(model=DEMO, prompt=PROMPTS[4], max_tokens=12, seed=2,
                                      temperature=0.0, extra_body={"instruction_length": "prompt"})
    assert reply.choices[0].text == offline(reference, PROMPTS[4], 12, 2, temperature=0.0,
                                            instruction_length=len(ids))[0]


def test_token_id_prompt_and_default_max_tokens(client, reference):
    ids = reference.encode(PROMPTS[1])
    reply = client.completions.create(model=DEMO, prompt=ids, seed=5)
    assert reply.choices[0].text == offline(reference, ids, 16, 5)[0]   # OpenAI's default 16
    assert reply.usage.completion_tokens == 16


def test_streamed_completion_equals_plain(client, reference):
    chunks = list(client.completions.create(model=DEMO, prompt=PROMPTS[2], max_tokens=30, seed=3,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline(reference, PROMPTS[2], 30, 3)[0]
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1   # really streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30


def test_stream_ends_with_done(demo):
    body = dict(model=DEMO, prompt=PROMPTS[3], max_tokens=5, seed=1, stream=True)
    with httpx.stream("POST", demo + "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_text_stop_cuts_the_reply(client, reference, stream):
    full, _ = offline(reference, PROMPTS[4], 60, 9, 0.0)
    stop = full[20:22]                  # a piece of the reply: it stops at the first occurrence
    reply = client.completions.create(model=DEMO, prompt=PROMPTS[4], max_tokens=60, seed=9,
                                      temperature=0, stop=[stop, "no such text"], stream=stream)
    chunks = list(reply) if stream else [reply]
    text = "".join(c.choices[0].text for c in chunks)
    assert text == full[:full.index(stop)] and stop not in text
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("pieces, stops, shown, stopped", [
    (["ab", "c\n", "\nd"], ("\n\n",), ["ab", "c", ""], True),      # spans two pieces
    (["ab", "c\n", "d"], ("\n\n",), ["ab", "c", "\nd"], False),     # held back, then shown
    (["x<e", "nd>y"], ("<end>", "nd"), ["x", ""], True),            # the earliest one wins
    (["x<e", "n"], ("<end>",), ["x", "<en"], False),                # the last piece shows all
    (["abc"], (), ["abc"], False),
])
def test_stop_text_holds_back_what_may_start_a_stop(pieces, stops, shown, stopped):
    matcher, got, hit = StopText(stops), [], False
    for i, piece in enumerate(pieces):
        text, hit = matcher.feed(piece, final=i == len(pieces) - 1)
        got.append(text)
        if hit:
            break
    assert (got, hit) == (shown, stopped)


def test_concurrent_streams_equal_offline_generate(demo, reference):
    """32 streams at once, each with its own prompt and seed: every one gets generate's text."""
    calls = [(PROMPTS[i % len(PROMPTS)], 100 + i) for i in range(32)]

    async def one(client, prompt, seed):
        stream = await client.completions.create(model=DEMO, prompt=prompt, max_tokens=12,
                                                 seed=seed, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run():
        async with openai.AsyncOpenAI(base_url=demo + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p, s) for p, s in calls))

    texts = asyncio.run(run())
    assert texts == [offline(reference, p, 12, s)[0] for p, s in calls]
    assert len(set(texts)) > 16                 # the seeds mattered


# -- cancellation ------------------------------------------------------------------------------
def test_closing_a_stream_cancels_its_request(demo, client, reference):
    before = metrics(demo)
    stream = client.completions.create(model=DEMO, prompt=PROMPTS[5], max_tokens=900, seed=2,
                                       stream=True, extra_body=dict(loops=SLOW_LOOPS))
    for _, _ in zip(range(3), stream):
        pass
    stream.close()
    after = wait_for(demo, lambda m: m[finished("cancelled")] == before[finished("cancelled")] + 1
                     and idle(m))
    generated = (after["tinyloop_generation_tokens_total"]
                 - before["tinyloop_generation_tokens_total"])
    assert 3 <= generated < 900                 # it stopped early
    check_completion(client, reference, SAMPLINGS[0])


def test_a_client_that_gives_up_cancels_its_request(demo):
    before = metrics(demo)
    body = dict(model=DEMO, prompt=PROMPTS[6], max_tokens=1000, seed=4, loops=SLOW_LOOPS)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(demo + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.3))
    after = wait_for(demo, lambda m: m[finished("cancelled")] == before[finished("cancelled")] + 1
                     and idle(m))
    generated = (after["tinyloop_generation_tokens_total"]
                 - before["tinyloop_generation_tokens_total"])
    assert generated < 1000                     # it stopped early


def test_slow_and_half_closed_clients_do_not_stall_the_server(demo, client, reference):
    """32 clients that send their headers a few bytes at a time and never finish (slowloris),
    and 8 that send a whole streaming request, half-close their side and never read: meanwhile
    a normal request is answered as offline generate, the half-closed requests leave the engine
    (ASGI reports a half-close as a disconnect, which cancels the request) instead of holding
    it, and once the slow clients go the server is healthy and serves as before."""
    address = httpx.URL(demo)
    slow = [socket.create_connection((address.host, address.port)) for _ in range(32)]
    for sock in slow:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: tinyloop\r\nContent-Le")
    half = []
    for i in range(8):
        body = json.dumps(dict(model=DEMO, prompt=PROMPTS[i], max_tokens=300, seed=i,
                               stream=True, loops=SLOW_LOOPS)).encode()
        sock = socket.create_connection((address.host, address.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: tinyloop\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)
        sock.shutdown(socket.SHUT_WR)
        half.append(sock)
    check_completion(client, reference, SAMPLINGS[0])
    for sock in slow:
        sock.sendall(b"ngth: ")                  # still trickling
    wait_for(demo, idle, timeout=60)             # a half-close is a disconnect: cancelled
    for sock in slow + half:
        sock.close()
    assert healthy(demo)
    check_completion(client, reference, SAMPLINGS[1])


# -- metrics -----------------------------------------------------------------------------------
def test_metrics_count_requests_tokens_and_cache_hits(demo, client):
    prompt = " ".join(PROMPTS) * 3                          # long enough for whole KV blocks
    before = metrics(demo)
    for seed in (1, 2):                                     # the second finds the first's prefix
        client.completions.create(model=DEMO, prompt=prompt, max_tokens=4, seed=seed)
    after = wait_for(demo, idle)

    def delta(name):
        return after[name] - before.get(name, 0)

    n_prompt = len(prompt.encode())
    assert delta("tinyloop_prompt_tokens_total") == 2 * n_prompt
    assert delta("tinyloop_generation_tokens_total") == 8
    assert delta(finished("length")) == 2
    assert delta("tinyloop_prefix_cache_queries_total") >= 2
    assert delta("tinyloop_prefix_cache_hit_tokens_total") >= n_prompt - 2 * 16
    assert delta("tinyloop_time_to_first_token_seconds_count") == 2
    assert delta("tinyloop_inter_token_latency_seconds_count") == 6
    assert after["tinyloop_kv_blocks"] == after["tinyloop_kv_bytes"] == 0


# -- the KV budget -----------------------------------------------------------------------------
def kv_block_bytes(model):
    """The KV bytes of one block of positions of `model`, as its Scheduler counts them: what a
    one-token request holds after its first step."""
    with tinyloop.Scheduler(model) as scheduler:
        scheduler.add([1], max_tokens=2)
        scheduler.step()
        return scheduler.stats()["kv_bytes"]


def test_burst_beyond_the_kv_budget_loses_nothing(reference):
    """Room for the KV of two or three requests, twelve at once: the scheduler preempts and
    recomputes, and every reply is still generate's."""
    with serving(max_batch=12, step_tokens=64, kv_budget_bytes=8 * kv_block_bytes(reference),
                 prefix_cache_bytes=0) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        calls = [(f"{PROMPTS[i % len(PROMPTS)]} {i}:", 200 + i) for i in range(12)]
        texts = [None] * len(calls)

        def one(i):
            prompt, seed = calls[i]
            texts[i] = client.completions.create(model=DEMO, prompt=prompt, max_tokens=20,
                                                 seed=seed).choices[0].text

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert texts == [offline(reference, p, 20, s)[0] for p, s in calls]
        assert metrics(url)["tinyloop_preemptions_total"] > 0
        # a request that could not fit alone is refused, naming the prompt
        response = httpx.post(url + "/v1/completions",
                              json=dict(model=DEMO, prompt=PROMPTS[0] * 20, max_tokens=200))
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "prompt"
        assert "kv_budget_bytes" in response.json()["error"]["message"]


def test_a_prefix_another_tenant_cached_is_no_hit_and_costs_the_same_work(demo, reference):
    """cache_salt isolates tenants (docs/serving.md "Tenants"): tenant b asking for the prompt
    tenant a has cached takes no cached prompt token and prefills the whole prompt, exactly
    the work of a prompt nobody cached, so no latency tells b what a asked; only b's own
    repeat hits, as much as a's did. Every reply is offline generate's."""
    prompt = ("You are the assistant of a tenant whose instructions nobody else may learn. " * 3
              + "Question:")
    unseen = prompt.swapcase()                      # the same length, no block in common

    def ask(text, salt):
        """(cached prompt tokens, prefilled tokens) of one request, checked against generate."""
        before = wait_for(demo, idle)
        body = dict(model=DEMO, prompt=text, max_tokens=6, seed=9)
        if salt is not None:
            body["cache_salt"] = salt
        reply = httpx.post(demo + "/v1/completions", json=body, timeout=60)
        assert reply.json()["choices"][0]["text"] == offline(reference, text, 6, 9)[0]
        after = wait_for(demo, idle)
        return tuple(after[name] - before[name] for name in
                     ("tinyloop_cached_prompt_tokens_total", "tinyloop_prefill_tokens_total"))

    cold = ask(unseen, "tenant-b")
    assert cold[0] == 0 and cold[1] >= len(unseen)
    assert ask(prompt, "tenant-a")[0] == 0
    own = ask(prompt, "tenant-a")
    assert own[0] > 0                               # a's own repeat hits
    assert ask(prompt, "tenant-b") == cold          # a's blocks: no hit, the same work
    assert ask(prompt, None) == cold                # nor for the default tenant (no salt)
    assert ask(prompt, "tenant-b") == own           # b's own repeat hits as a's did


def test_beyond_max_batch_and_max_queue_a_request_is_answered_429_with_retry_after(reference):
    """max_batch 2 + max_queue 2: four slow streams hold the engine, so a fifth request is a
    429 with Retry-After and the OpenAI error body, counted in /metrics, and costs the engine
    nothing; closing the streams frees their room. Then a flood of 16 at once: every answer is
    a 200 equal to offline generate or a 429, and the 429s are the count /metrics adds."""
    with serving(max_batch=2, step_tokens=64, max_queue=2, prefix_cache_bytes=0) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        streams = [client.completions.create(model=DEMO, prompt=PROMPTS[i], max_tokens=900,
                                             seed=i, stream=True, extra_body=dict(loops=SLOW_LOOPS))
                   for i in range(4)]          # each returns once the engine holds it
        response = httpx.post(url + "/v1/completions",
                              json=dict(model=DEMO, prompt=PROMPTS[4], max_tokens=4))
        error = error_of(response, 429)
        assert (error["type"], error["code"], error["param"]) == ("rate_limit_exceeded",
                                                                  "queue_full", None)
        assert "max_batch + max_queue = 4" in error["message"]
        assert response.headers["Retry-After"] == "1"
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=DEMO, prompt=PROMPTS[4], max_tokens=4)
        assert metrics(url)["tinyloop_requests_rejected_total"] == 2
        for stream in streams:
            stream.close()
        wait_for(url, idle)

        calls = [(f"{PROMPTS[i % len(PROMPTS)]} {i}:", 300 + i) for i in range(16)]
        answers = [None] * len(calls)

        def one(i):
            prompt, seed = calls[i]
            answers[i] = httpx.post(url + "/v1/completions", timeout=120, json=dict(
                model=DEMO, prompt=prompt, max_tokens=12, seed=seed))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        statuses = [answer.status_code for answer in answers]
        assert set(statuses) <= {200, 429} and 200 in statuses, statuses
        for (prompt, seed), answer in zip(calls, answers):
            if answer.status_code == 200:
                assert answer.json()["choices"][0]["text"] == offline(reference, prompt, 12, seed)[0]
            else:
                assert answer.headers["Retry-After"] == "1"
        assert metrics(url)["tinyloop_requests_rejected_total"] == 2 + statuses.count(429)


def test_256_concurrent_streams_against_a_small_kv_budget_lose_nothing(reference):
    """256 streamed completions at once against room for the KV of a few requests (32 run at a
    time, the rest queued, the newest preempted and recomputed): every stream's text is offline
    generate's, and the engine ends idle."""
    with serving(max_batch=32, step_tokens=128, kv_budget_bytes=12 * kv_block_bytes(reference),
                 prefix_cache_bytes=0) as url:
        calls = [(f"{PROMPTS[i % len(PROMPTS)]} {i}:", 1000 + i) for i in range(256)]

        async def one(http, prompt, seed):
            body = dict(model=DEMO, prompt=prompt, max_tokens=6, seed=seed, stream=True)
            text = ""
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text

        async def all_at_once():
            limits = httpx.Limits(max_connections=256)
            async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
                return await asyncio.gather(*(one(http, p, s) for p, s in calls))

        texts = asyncio.run(all_at_once())
        assert texts == [offline(reference, p, 6, s)[0] for p, s in calls]
        assert metrics(url)["tinyloop_preemptions_total"] > 0
        wait_for(url, idle)


# -- chat --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return hf_model(tmp_path_factory.mktemp("serve") / "chat.tinyloop")


@pytest.fixture(scope="module")
def chat_url(chat_model):
    with serving(chat_model, model_name="tiny-chat") as url:
        yield url


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello wörld"},
            {"role": "assistant", "content": "the quick brown fox"},
            {"role": "user", "content": [{"type": "text", "text": "naïve "},
                                         {"type": "text", "text": "café?"}]}]


def offline_chat(path, messages, max_tokens, seed, **kwargs):
    """The reply Model.generate gives for the rendered conversation (with Model.generate's
    `kwargs`), stopping at the end of turn as tinyloop.Chat does, without the end of turn's
    text (the demo model's is a newline); and its token count."""
    with tinyloop.Model(path, prefix_cache_bytes=0) as model:
        rendered = [dict(m, content=m["content"] if isinstance(m["content"], str)
                         else "".join(part["text"] for part in m["content"])) for m in messages]
        ids = model.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True)
        ends = end_of_turn_stops(model.tokenizer, model.stop_token_ids())
        text, n = offline(model, ids, max_tokens, seed, stop_sequences=[[end] for end in ends],
                          **kwargs)
        for end in ends:
            text = text.removesuffix(model.decode([end], skip_special_tokens=True))
        return text, n


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_offline_generate(chat_url, chat_model, stream):
    client = openai.OpenAI(base_url=chat_url + "/v1", api_key="unused", max_retries=0)
    want, n = offline_chat(chat_model, MESSAGES, 20, 8)
    reply = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, seed=8,
                                           max_completion_tokens=20, stream=stream)
    if stream:
        chunks = list(reply)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    else:
        assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
        text = reply.choices[0].message.content
        assert reply.usage.completion_tokens == n
        assert reply.choices[0].finish_reason == ("length" if n == 20 else "stop")
    assert text == want


def test_speculative_streamed_chat_equals_plain_generate(chat_url, chat_model):
    """A streamed chat reply drafting at depth 1 of the model's 2 is the plain reply."""
    client = openai.OpenAI(base_url=chat_url + "/v1", api_key="unused", max_retries=0)
    before = metrics(chat_url)
    chunks = list(client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, seed=8, max_completion_tokens=20, stream=True,
        temperature=0.0, extra_body=SPECULATIVE))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == offline_chat(chat_model, MESSAGES, 20, 8, temperature=0.0)[0]
    after = wait_for(chat_url, idle)
    assert after["tinyloop_draft_tokens_total"] > before["tinyloop_draft_tokens_total"]


# -- the engine loop -----------------------------------------------------------------------------
def test_engine_loop_survives_a_failed_step_and_a_refused_add(reference):
    """A step that raises fails the requests it ran, a refused add fails its own request, and
    the next request is served exactly as if nothing had happened."""
    engine = EngineLoop(reference, max_batch=4, step_tokens=16,
                        kv_budget_bytes=8 * kv_block_bytes(reference))
    step, failures = engine._scheduler.step, []

    def failing_step():
        if not failures:
            failures.append("raised")
            raise RuntimeError("injected failure")
        return step()

    engine._scheduler.step = failing_step
    prompt = reference.encode(PROMPTS[0])

    async def tokens(**kwargs):
        return [event.token async for event in engine.generate(prompt, **kwargs)]

    async def run():
        with pytest.raises(RuntimeError, match="the engine failed: injected failure"):
            await tokens(max_tokens=8, seed=1)
        with pytest.raises(ValueError, match="kv_budget_bytes"):
            await tokens(max_tokens=900, seed=1)
        return await asyncio.gather(*(tokens(max_tokens=8, seed=s, temperature=1.0)
                                      for s in range(6)))

    engine.start()
    try:
        got = asyncio.run(asyncio.wait_for(run(), ENGINE_TIMEOUT))
    finally:
        engine.stop()
    assert failures == ["raised"]
    assert got == [reference.generate(prompt, max_tokens=8, seed=s, temperature=1.0)[len(prompt):]
                   for s in range(6)]
    assert engine.stats["running"] == engine.stats["waiting"] == 0


def test_engine_loop_retries_a_step_out_of_memory_without_losing_a_token(reference):
    """A step that runs out of memory (twice here) is retried: every request still gets
    exactly offline generate's tokens."""
    engine = EngineLoop(reference, max_batch=4, step_tokens=16)
    step, failures = engine._scheduler.step, []

    def failing_step():
        if len(failures) < 2 and engine.stats["steps"] >= 2:
            failures.append("raised")
            raise MemoryError("injected")
        return step()

    engine._scheduler.step = failing_step
    prompt = reference.encode(PROMPTS[1])

    async def run():
        async def tokens(seed):
            return [e.token async for e in engine.generate(prompt, max_tokens=8, seed=seed,
                                                           temperature=1.0)]
        return await asyncio.gather(*(tokens(s) for s in range(4)))

    engine.start()
    try:
        got = asyncio.run(asyncio.wait_for(run(), ENGINE_TIMEOUT))
    finally:
        engine.stop()
    assert failures == ["raised", "raised"]
    assert got == [reference.generate(prompt, max_tokens=8, seed=s, temperature=1.0)[len(prompt):]
                   for s in range(4)]


def test_engine_loop_cancels_an_abandoned_request(reference):
    engine = EngineLoop(reference, max_batch=2, step_tokens=16)

    async def run():
        events = engine.generate(reference.encode(PROMPTS[1]), max_tokens=900, seed=3,
                                 loops=SLOW_LOOPS)
        first = await events.__anext__()
        await events.aclose()
        return first

    engine.start()
    try:
        assert asyncio.run(asyncio.wait_for(run(), ENGINE_TIMEOUT)).finish is None
        deadline = time.monotonic() + 10
        while engine.stats["cancelled"] != 1:
            assert time.monotonic() < deadline, engine.stats
            time.sleep(0.01)
        assert engine.stats["running"] == 0 and engine.stats["generated_tokens"] < 900
    finally:
        engine.stop()


# -- bad requests ------------------------------------------------------------------------------
GOOD = dict(model=DEMO, prompt="And", max_tokens=2)
BAD_COMPLETIONS = [
    (dict(GOOD, model="gpt-4"), 404, "model"),
    ({k: v for k, v in GOOD.items() if k != "model"}, 400, "model"),
    (dict(GOOD, model=3), 400, "model"),
    ({k: v for k, v in GOOD.items() if k != "prompt"}, 400, "prompt"),
    (dict(GOOD, prompt=7), 400, "prompt"),
    (dict(GOOD, prompt=""), 400, "prompt"),
    (dict(GOOD, prompt=[1, 999]), 400, "prompt"),
    (dict(GOOD, prompt=["a", "b"]), 400, "prompt"),
    (dict(GOOD, prompt="x" * 1100), 400, "prompt"),
    (dict(GOOD, max_tokens=1022), 400, "max_tokens"),
    (dict(GOOD, max_tokens=0), 400, "max_tokens"),
    (dict(GOOD, max_tokens=1.5), 400, "max_tokens"),
    (dict(GOOD, max_tokens="2"), 400, "max_tokens"),
    (dict(GOOD, temperature=-1), 400, "temperature"),
    (dict(GOOD, temperature="hot"), 400, "temperature"),
    (dict(GOOD, top_p=0), 400, "top_p"),
    (dict(GOOD, top_p=1.5), 400, "top_p"),
    (dict(GOOD, top_k=-1), 400, "top_k"),
    (dict(GOOD, repetition_penalty=0), 400, "repetition_penalty"),
    (dict(GOOD, loops=0), 400, "loops"),
    (dict(GOOD, loops=True), 400, "loops"),
    (dict(GOOD, draft_loops=6), 400, "draft_loops"),           # the demo model's depth
    (dict(GOOD, loops=2, draft_loops=2), 400, "draft_loops"),
    (dict(GOOD, draft_loops=-1), 400, "draft_loops"),
    (dict(GOOD, draft_loops=1.5), 400, "draft_loops"),
    (dict(GOOD, draft_loops="1"), 400, "draft_loops"),
    (dict(GOOD, n_draft=4), 400, "n_draft"),                  # without draft_loops
    (dict(GOOD, draft_loops=1, n_draft=65), 400, "n_draft"),
    (dict(GOOD, draft_loops=1, n_draft=-1), 400, "n_draft"),
    (dict(GOOD, draft_loops=1, n_draft=True), 400, "n_draft"),
    (dict(GOOD, exit_rule="deep"), 400, "exit_rule"),
    (dict(GOOD, exit_rule="gate"), 400, "exit_rule"),          # the demo model has no gate
    (dict(GOOD, exit_rule=3), 400, "exit_rule"),
    (dict(GOOD, exit_threshold=0.5), 400, "exit_threshold"),   # without exit_rule
    (dict(GOOD, exit_rule="latent", exit_threshold=0), 400, "exit_threshold"),
    (dict(GOOD, exit_rule="argmax", exit_threshold=1.5), 400, "exit_threshold"),
    (dict(GOOD, exit_rule="latent", min_loops=7), 400, "min_loops"),
    (dict(GOOD, exit_rule="latent", draft_loops=1), 400, "exit_rule"),
    (dict(GOOD, seed=-1), 400, "seed"),
    (dict(GOOD, seed=1 << 64), 400, "seed"),
    (dict(GOOD, n=2), 400, "n"),
    (dict(GOOD, stop=5), 400, "stop"),
    (dict(GOOD, stop=[""]), 400, "stop"),
    (dict(GOOD, stream="yes"), 400, "stream"),
    (dict(GOOD, stream_options={"include_usage": True}), 400, "stream_options"),
    (dict(GOOD, cache_salt=5), 400, "cache_salt"),
    (dict(GOOD, cache_salt="a\0b"), 400, "cache_salt"),
    (dict(GOOD, instruction_length=-1), 400, "instruction_length"),
    (dict(GOOD, instruction_length=10 ** 6), 400, "instruction_length"),
    (dict(GOOD, instruction_length="all"), 400, "instruction_length"),
    (dict(GOOD, logprobs=3), 400, "logprobs"),
    (dict(GOOD, frobnicate=1), 400, "frobnicate"),
]
CHAT = dict(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
BAD_CHATS = [
    (dict(CHAT, model=DEMO), 404, "model"),
    (dict(CHAT, messages=[]), 400, "messages"),
    (dict(CHAT, messages="hi"), 400, "messages"),
    (dict(CHAT, messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    (dict(CHAT, messages=[{"role": "user"}]), 400, "messages[0].content"),
    (dict(CHAT, messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    (dict(CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content"),
    (dict(CHAT, messages=[{"role": "user", "content": "hello " * 200}]), 400, "messages"),
    (dict(CHAT, max_completion_tokens=0), 400, "max_completion_tokens"),
    (dict(CHAT, max_tokens=100000), 400, "max_tokens"),       # past max_seq_len
    (dict(CHAT, prompt="hi"), 400, "prompt"),                 # a completion's field
]


def error_of(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def check_error(url, path, body, status, param):
    error = error_of(httpx.post(url + path, json=body), status)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "model_not_found"


@pytest.mark.parametrize("body, status, param", BAD_COMPLETIONS)
def test_bad_completion_names_the_field(demo, body, status, param):
    check_error(demo, "/v1/completions", body, status, param)


@pytest.mark.parametrize("body, status, param", BAD_CHATS)
def test_bad_chat_names_the_field(chat_url, body, status, param):
    check_error(chat_url, "/v1/chat/completions", body, status, param)


DEMO_CHAT = [{"role": "system", "content": "The Gospel According to Saint John"},
             {"role": "user", "content": "In the beginning was the Word."}]


@pytest.mark.parametrize("stream", [False, True])
def test_the_demo_model_chats_out_of_the_box(demo, client, stream):
    """`tinyloop serve`'s default model answers a newcomer's first chat request: one line of
    verse, ended by its end-of-turn newline (finish_reason "stop"), which the content leaves
    out; exactly the offline reply."""
    want, n = offline_chat(None, DEMO_CHAT, 200, 2, temperature=0.7)
    assert want and n < 200              # the seed gives a reply that ends at its newline
    reply = client.chat.completions.create(model=DEMO, messages=DEMO_CHAT, seed=2,
                                           temperature=0.7, max_tokens=200, stream=stream)
    if stream:
        chunks = list(reply)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert reply.usage.completion_tokens == n
    assert (text, finish) == (want, "stop")
    assert "\n" not in text


def test_chat_needs_a_chat_template(tmp_path):
    path = tmp_path / "no-template.tinyloop"
    tinyloop.random_model(path, tokenizer="bytes", vocab_size=256, d_model=16, n_heads=2,
                          n_kv_heads=1, head_dim=8, ffn_dim=16, n_pre_blocks=0, default_loops=1,
                          max_seq_len=64)
    with serving(path, model_name="plain") as url:
        error = error_of(httpx.post(url + "/v1/chat/completions",
                                    json=dict(CHAT, model="plain")), 400)
    assert error["param"] == "messages" and "no chat template" in error["message"]


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_body_that_is_not_a_json_object(demo, content):
    error_of(httpx.post(demo + "/v1/completions", content=content), 400)


def test_unknown_paths_and_methods(demo):
    assert error_of(httpx.get(demo + "/v2/nothing"), 404)["code"] == "unknown_url"
    error_of(httpx.get(demo + "/v1/completions"), 405)


def test_the_server_survives_a_barrage_of_bad_requests(demo, client, reference):
    with httpx.Client(base_url=demo) as http:
        for _ in range(3):
            for body, status, _ in BAD_COMPLETIONS:
                assert http.post("/v1/completions", json=body).status_code == status
            for content in (b"{", b"null", b'{"model": "tinyloop-demo", "prompt": NaN}'):
                assert http.post("/v1/completions", content=content).status_code == 400
    assert healthy(demo)
    check_completion(client, reference, SAMPLINGS[2])


# Hypothesis-drawn request bodies: every field the endpoints read, each a valid value or any
# JSON (small numbers, so a valid draw never runs long), plus unknown keys.
JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 40)
                    | st.sampled_from([1 << 31, 1 << 63, -(1 << 63), 10 ** 30])
                    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
MESSAGE = st.fixed_dictionaries({}, optional={"role": st.sampled_from(
    ["user", "assistant", "system", "developer", "tool"]) | JSON, "content": st.text(max_size=30)
    | st.lists(st.fixed_dictionaries({"type": st.just("text") | JSON, "text": st.text(max_size=9)
                                      | JSON}), max_size=2) | JSON, "name": JSON})
FIELDS = {
    "model": st.sampled_from([DEMO, "tiny-chat"]) | JSON,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-3, 300), max_size=8) | JSON,
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "max_tokens": st.integers(-1, 6) | JSON, "max_completion_tokens": st.integers(-1, 6) | JSON,
    "temperature": st.floats(-1, 3) | JSON, "top_p": st.floats(-0.5, 1.5) | JSON,
    "top_k": st.integers(-1, 60) | JSON, "repetition_penalty": st.floats(0, 2) | JSON,
    "seed": st.integers(-1, 1 << 64) | JSON, "loops": st.integers(-1, 5) | JSON,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=5) | JSON,
    "stream": st.booleans() | JSON, "stream_options": JSON, "n": st.integers(0, 2) | JSON,
    "cache_salt": st.text(max_size=6) | JSON, "draft_loops": st.integers(-1, 3) | JSON,
    "n_draft": st.integers(-1, 5) | JSON, "exit_rule": st.sampled_from(
        ["none", "gate", "latent", "kl", "argmax"]) | JSON, "exit_threshold": JSON,
    "min_loops": JSON, "instruction_length": st.integers(-1, 40) | JSON, "logprobs": JSON, "echo": JSON, "user": JSON, "frobnicate": JSON}
BODIES = st.fixed_dictionaries({}, optional=FIELDS)


@given(body=BODIES | JSON, chat=st.booleans())
@settings(deadline=None)
def test_any_request_body_gets_an_openai_answer_never_a_500(demo, chat_url, body, chat):
    """Whatever the body: a 200 with a completion (or an event stream ending in [DONE]), or
    an OpenAI error body (400, 404; 429 when full), within the timeout: never a 500 or a hang."""
    url = chat_url if chat else demo
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = httpx.post(url + path, content=json.dumps(body), timeout=60,  # NaN, Infinity too
                          headers={"content-type": "application/json"})
    assert response.status_code in (200, 400, 404, 429), response.text
    if response.status_code != 200:
        error_of(response, response.status_code)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text
    else:
        assert response.json()["choices"], response.text


def test_health_is_503_until_the_model_has_loaded(tmp_path):
    """A model that cannot load leaves /health at 503 with the reason; nothing crashes."""
    broken = tmp_path / "broken.tinyloop"
    broken.write_bytes(b"not a model")
    with running(create_app(broken)) as url:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            with contextlib.suppress(httpx.TransportError):
                error = httpx.get(url + "/health").json()["error"]
                if "failed to load" in error["message"]:
                    break
            assert time.monotonic() < deadline, "the load failure was never reported"
            time.sleep(0.05)
        assert httpx.get(url + "/health").status_code == 503
        assert error_of(httpx.get(url + "/v1/models"), 503)["type"] == "service_unavailable"


def test_a_model_without_a_tokenizer_is_refused_with_the_reason(tmp_path):
    """The server answers in text: a token-only model is never served (no 500 per request)."""
    path = tmp_path / "ids-only.tinyloop"
    tinyloop.random_model(path, vocab_size=64, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8,
                          ffn_dim=16, n_pre_blocks=0, default_loops=1, max_seq_len=64)
    with running(create_app(path)) as url:
        deadline = time.monotonic() + START_TIMEOUT
        while "has no tokenizer" not in httpx.get(url + "/health").text:
            assert time.monotonic() < deadline, "the refusal was never reported"
            time.sleep(0.05)
        reply = httpx.post(url + "/v1/completions", json={"model": "x", "prompt": [1, 2, 3]})
        assert error_of(reply, 503)["message"].startswith("the model failed to load: model")


def test_cli_checks_the_scheduler_flags_before_serving(capsys):
    assert main(["serve", "--max-batch", "8", "--step-tokens", "4"]) == 2
    assert "--step-tokens 4 is less than --max-batch 8" in capsys.readouterr().err


def test_cli_serves_until_interrupted(tmp_path):
    """`tinyloop serve` in a process of its own: it serves, and Ctrl-C stops it with code 0."""
    with serve_process(["--model-name", "kjv", "--max-batch", "4", "--step-tokens", "64"],
                       tmp_path / "serve.log") as url:
        reply = httpx.post(url + "/v1/completions",
                           json=dict(model="kjv", prompt=PROMPTS[0], max_tokens=3)).json()
        assert reply["usage"]["completion_tokens"] == 3
    assert "Uvicorn running on" in (tmp_path / "serve.log").read_text()
