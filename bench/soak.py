"""A soak of `tinyloop serve`: a steady mixed load for a fixed time, watching the server process.

The server runs the demo model (or --model) with a small prefix cache backed by the disk tier,
so blocks spill and come back all the time. `--clients` threads each loop: a request whose
prompt is one of a few shared system prompts plus a fresh question, streamed or not, and one
in --cancel-share of them closed after its first chunk (the request is cancelled in the
engine). Every --interval seconds the monitor records the server's resident memory (VmRSS)
and open file descriptors. At the end the server is stopped with Ctrl-C, and a sample
(--sample, 5% by default) of the completed requests is replayed with offline
`Model.generate` (same prompt ids, seed and max_tokens, no cache): the texts must be equal.

Reported (printed, and bench/results/soak.md / .json): RSS and fds over time, their growth
from the first tenth of the run to the last, requests served / cancelled, errors (any status
but 200, any exception), and the sampled replies that differ (must be 0).

usage: python bench/soak.py [--minutes 30] [--clients 8] [--model PATH]
"""
import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

import tinyloop
from common import write_results

SYSTEMS = ["You are a careful assistant. Answer in one short line. ",
           "The following is a conversation about the book of Genesis. ",
           "Translate the question into plain words, then answer it briefly. ",
           "You are terse. "]
QUESTIONS = ["And God said", "In the beginning", "Blessed are they", "And Jesus answered",
             "Thus saith the LORD", "And it came to pass", "Let there be", "The LORD is"]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--model", default=None, help="a .tinyloop file (default: the demo model)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--sample", type=float, default=0.05, help="share of replies replayed")
    parser.add_argument("--cancel-share", type=float, default=0.1)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--name", default="soak", help="bench/results/<name>.md")
    return parser.parse_args(argv)


def start_server(args, cache_dir, log):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "tinyloop", "serve", *([args.model] if args.model else []),
               "--port", str(port), "--max-batch", "8", "--step-tokens", "256",
               "--prefix-cache-bytes", str(1 << 20), "--prefix-cache-dir", cache_dir,
               "--prefix-cache-disk-bytes", str(64 << 20)]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            break
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not start; see its log")


DISK_COUNTERS = ("tinyloop_prefix_cache_spilled_blocks_total",
                 "tinyloop_prefix_cache_disk_hit_blocks_total",
                 "tinyloop_prefix_cache_disk_write_failures_total")


def disk_counters(url):
    """(blocks spilled, blocks read back, failed writes) from the server's /metrics."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in DISK_COUNTERS:
            values[name] = int(float(value))
    return tuple(values.get(name, 0) for name in DISK_COUNTERS)


def process_sample(pid):
    """(resident MiB, open file descriptors) of process pid."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss / 1024, len(os.listdir(f"/proc/{pid}/fd"))


class Load:
    """The clients' shared tallies."""

    def __init__(self, args, url, end):
        self.args, self.url, self.end = args, url, end
        self.lock = threading.Lock()
        self.served = self.cancelled = 0
        self.errors = []
        self.samples = []              # (prompt, seed, max_tokens, text)

    def client(self, index):
        rng = random.Random(index)
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while time.monotonic() < self.end:
                prompt = rng.choice(SYSTEMS) + rng.choice(QUESTIONS) + f" ({rng.randrange(10**6)}):"
                seed = rng.randrange(1 << 31)
                body = dict(model="tinyloop-demo", prompt=prompt, max_tokens=self.args.max_tokens,
                            seed=seed, stream=rng.random() < 0.5)
                cancel = rng.random() < self.args.cancel_share
                try:
                    text = self.one(http, body, cancel)
                except Exception as exc:      # every failure is counted, none stops the soak
                    with self.lock:
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                with self.lock:
                    if cancel:
                        self.cancelled += 1
                        continue
                    self.served += 1
                    if rng.random() < self.args.sample:
                        self.samples.append((prompt, seed, self.args.max_tokens, text))

    @staticmethod
    def one(http, body, cancel):
        if not body["stream"] and not cancel:
            response = http.post("/v1/completions", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"status {response.status_code}: {response.text[:200]}")
            return response.json()["choices"][0]["text"]
        body["stream"] = True
        text = ""
        with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"status {response.status_code}")
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    if cancel:
                        return text                 # closing the stream cancels the request
        return text


def replay(model_path, samples):
    """The sampled replies that differ from offline generate's."""
    differ = 0
    with tinyloop.Model(model_path, prefix_cache_bytes=0) as model:
        for prompt, seed, max_tokens, text in samples:
            ids = model.encode(prompt)
            out = model.generate(ids, max_tokens=max_tokens, seed=seed, temperature=1.0,
                                 top_k=0)[len(ids):]
            differ += model.decode(out, skip_special_tokens=True) != text
    return differ


def main(argv=None):
    args = parse_args(argv)
    cache_dir = tempfile.mkdtemp(prefix="tinyloop-soak-")
    log = open(os.path.join(cache_dir, "server.log"), "w")
    process, url = start_server(args, os.path.join(cache_dir, "tier"), log)
    started = time.monotonic()
    end = started + 60 * args.minutes
    load = Load(args, url, end)
    clients = [threading.Thread(target=load.client, args=(i,), daemon=True)
               for i in range(args.clients)]
    for thread in clients:
        thread.start()
    rows = []
    while time.monotonic() < end:
        rss, fds = process_sample(process.pid)
        with load.lock:
            served, cancelled, errors = load.served, load.cancelled, len(load.errors)
        spilled, disk_hits, _ = disk_counters(url)
        rows.append(dict(minute=(time.monotonic() - started) / 60, rss_mib=rss, fds=fds,
                         served=served, cancelled=cancelled, errors=errors, spilled=spilled,
                         disk_hits=disk_hits))
        print(f"{rows[-1]['minute']:6.1f} min  RSS {rss:7.1f} MiB  fds {fds:4d}  served {served}  "
              f"cancelled {cancelled}  errors {errors}  spilled {spilled}  disk hits {disk_hits}",
              flush=True)
        time.sleep(min(args.interval, max(0.0, end - time.monotonic())))
    for thread in clients:
        thread.join()
    rss, fds = process_sample(process.pid)
    spilled, disk_hits, write_failures = disk_counters(url)
    rows.append(dict(minute=(time.monotonic() - started) / 60, rss_mib=rss, fds=fds,
                     served=load.served, cancelled=load.cancelled, errors=len(load.errors),
                     spilled=spilled, disk_hits=disk_hits))
    process.send_signal(signal.SIGINT)
    code = process.wait(60)
    differ = replay(args.model, load.samples)
    tenth = max(1, len(rows) // 10)
    first = sum(r["rss_mib"] for r in rows[:tenth]) / tenth
    last = sum(r["rss_mib"] for r in rows[-tenth:]) / tenth
    notes = (f"{args.minutes:g} minutes, {args.clients} clients, {os.cpu_count()} CPUs "
             f"({subprocess.run(['lscpu'], capture_output=True, text=True).stdout.split('Model name:')[1].splitlines()[0].strip()}). "
             f"Served {load.served}, cancelled {load.cancelled}, errors {len(load.errors)}; "
             f"RSS {first:.1f} MiB over the first tenth, {last:.1f} over the last "
             f"({last - first:+.1f}); fds {rows[0]['fds']} -> {rows[-1]['fds']}; "
             f"{len(load.samples)} sampled replies replayed offline, {differ} differ; "
             f"disk tier: {spilled} blocks spilled, {disk_hits} read back, {write_failures} "
             f"failed writes; "
             f"server exit code {code}. Command: python bench/soak.py --minutes {args.minutes:g} "
             f"--clients {args.clients}")
    print(write_results(args.name, rows, ["minute", "rss_mib", "fds", "served", "cancelled",
                                          "errors", "spilled", "disk_hits"], notes,
                        formats={"minute": ".1f", "rss_mib": ".1f"}))
    for error in load.errors[:10]:
        print("error:", error)
    return 0 if not load.errors and not differ and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
