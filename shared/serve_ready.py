"""``inferq serve``'s ready line: a daemon thread polls the gateway's ``GET /ready``
(docs/operations.md, "Liveness and readiness") and, on the first 200, logs one line with
the URL, for example ``inferq ready: http://127.0.0.1:8000 (model SmolLM2-135M-Instruct,
1 worker)``. Until then the model may still be converting or the worker building its
CPU kernels, and requests would only queue."""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

#: Seconds between two ``/ready`` polls.
READY_POLL_INTERVAL_S = 0.5
#: Timeout of one poll, seconds.
READY_POLL_TIMEOUT_S = 2.0
_WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def http_url(host: str, port: int) -> str:
    """``http://host:port`` (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def announce_when_ready(host: str, port: int, stop: threading.Event | None = None) -> threading.Thread:
    """Start the daemon thread that logs the ready line once ``/ready`` answers 200 on
    ``host:port`` (a wildcard address is polled on loopback). It gives up when ``stop``
    is set. Returns the started thread."""
    stop = stop or threading.Event()
    url = http_url(host, port)
    poll_url = http_url(_WILDCARD_HOSTS.get(host, host), port) + "/ready"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy

    def poll() -> None:
        while not stop.is_set():
            try:
                with opener.open(poll_url, timeout=READY_POLL_TIMEOUT_S) as resp:
                    body = json.load(resp)
            except (OSError, ValueError):  # not listening yet, 503 (HTTPError), a bad body
                stop.wait(READY_POLL_INTERVAL_S)
                continue
            n = int(body.get("workers_ready", 0))
            log.info("inferq ready: %s (model %s, %d worker%s)", url, body.get("model"), n, "" if n == 1 else "s")
            return

    thread = threading.Thread(target=poll, name="inferq-ready", daemon=True)
    thread.start()
    return thread
