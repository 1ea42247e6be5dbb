"""A real `eagle-export serve` app on 127.0.0.1 (an ephemeral port) in a uvicorn thread, for the server tests."""

from __future__ import annotations

import re
import threading
import time

import httpx

from eagle_export.serve import ServeEngine, ServeOptions
from eagle_export.serve.server import make_server


class LiveServer:
    """Start with ``with LiveServer(ServeOptions(...)) as s:``; ``s.url`` is its base URL."""

    def __init__(self, opts: ServeOptions, engine: ServeEngine | None = None):
        """engine: an open one to serve (kept open on exit), else one opened here from ``opts``."""
        self.opts = opts
        self.own = engine is None
        self.engine = engine or ServeEngine.open(opts)
        self.server = make_server(self.engine, "127.0.0.1", 0, "warning")
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if self.own:
            self.engine.close()

    def stop(self, wait_s: float = 30) -> None:
        """What SIGTERM does (uvicorn's signal handler sets ``should_exit``): drain, then stop."""
        self.server.should_exit = True
        self.thread.join(timeout=wait_s)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kw)


def metric(text: str, name: str, **labels) -> float:
    """One sample's value from Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pat = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" ([0-9.e+-]+)$"
    m = re.search(pat, text, re.M)
    return float(m.group(1)) if m else 0.0


def sse_events(lines) -> list[dict | str]:
    """Parsed `data:` payloads of a server-sent event stream ('[DONE]' kept as a string)."""
    import json

    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
