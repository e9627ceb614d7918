"""`tinyloop serve` in a process of its own, for the tests that need a real one (Ctrl-C stopping
it, a restart on the same cache directory): a free loopback port, the output in a log file,
waiting for /health, then the interrupt and the exit code. Needs httpx (the caller skips
without it)."""
import contextlib
import signal
import socket
import subprocess
import sys
import time

START_TIMEOUT = 60          # seconds for the server to load its model and answer /health


@contextlib.contextmanager
def serve_process(args, log_path, killed=False, preexec_fn=None):
    """Yield the URL of `tinyloop serve *args --port PORT` once /health answers 200; then
    Ctrl-C it and assert that it exits with 0 (its log, at `log_path`, in the message).
    killed=True yields (URL, the process) instead, for a caller that kills it (SIGKILL: no
    shutdown runs); it must have exited by the end. preexec_fn runs in the server's process
    before it starts (e.g. a resource limit)."""
    with socket.socket() as probe:            # a free port (released for the server to take)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w+") as log:
        process = subprocess.Popen([sys.executable, "-m", "tinyloop", "serve", *args,
                                    "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                   preexec_fn=preexec_fn)
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not healthy(url):
                assert process.poll() is None and time.monotonic() < deadline, log_text(log)
                time.sleep(0.1)
            yield (url, process) if killed else url
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
            try:
                code = process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                raise
        assert code == (-signal.SIGKILL if killed else 0), log_text(log)


def healthy(url):
    """Whether the server at `url` answers /health with 200."""
    import httpx
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def log_text(log):
    log.seek(0)
    return log.read()
