"""`eagle-export serve --ray --replicas 2`: the same app as two Ray Serve replicas on a local Ray instance (2 CPUs),
one runtime each. Concurrent requests are answered by both replicas (each names itself in `x-eagle-replica`) and
every answer equals the runtime's own `generate`. About 30-60 s on 2 cores: Ray's processes and two runtimes."""

from __future__ import annotations

import os
import socket
import threading

import httpx
import pytest
from live_server import sse_events
from prometheus_client.parser import text_string_to_metric_families

from eagle_export.runtime import EagleRuntime
from eagle_export.serve import ServeOptions
from eagle_export.tools.testing.tiny_models import TINY_CHAT_TEMPLATE

MODEL = "tiny"
PROMPTS = ["def main():", "import os", "hello there", "class A:"]


@pytest.fixture(scope="module")
def art(models):
    return models("mha", vocab=256, with_tokenizer=True, chat_template=TINY_CHAT_TEMPLATE, max_batch=4,
                  max_seq_len=512)[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ray_serve_replicas_answer_and_are_lossless(art):
    import ray
    from ray import serve

    from eagle_export.serve.run import serve_ray

    rt = EagleRuntime.open(art)
    want = {p: rt.generate(p, max_new_tokens=24, stop_on_eos=False).tokens for p in PROMPTS}
    rt.close()
    port = _free_port()
    env = {"OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    os.environ.update({"RAY_USAGE_STATS_ENABLED": "0"})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env},
             object_store_memory=100 * 1024 * 1024)  # nothing is stored: keep the shared-memory store small
    try:
        opts = ServeOptions(str(art), model_name=MODEL, max_batch=4, max_queue=16, threads=1, timeout_s=60,
                            replica_header=True)
        serve_ray(opts, replicas=2, host="127.0.0.1", port=port, replica_cpus=0.5, block=False)
        replicas: set[str] = set()
        results: list = []
        lock = threading.Lock()

        def client(i: int) -> None:
            p = PROMPTS[i % 4]
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as h:
                r = h.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0,
                                                    "eagle": {"ignore_eos": True}})
            with lock:
                results.append((p, r.status_code, r.headers.get("x-eagle-replica"),
                                r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text))

        for _ in range(4):  # bounded: Ray's router spreads concurrent requests; stop once both have answered
            threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            replicas = {rep for _, code, rep, _ in results if code == 200}
            if len(replicas) >= 2:
                break
        assert all(code == 200 for _, code, _, _ in results), results
        assert len(replicas) == 2, f"only {replicas} answered"
        assert all(ids == want[p] for p, _, _, ids in results)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as h:
            assert h.get("/health").json()["status"] == "ok"
            body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0, "stream": True,
                    "eagle": {"ignore_eos": True}}
            with h.stream("POST", "/v1/completions", json=body) as r:  # server-sent events through Ray's proxy
                events = sse_events(r.iter_lines())
            assert events[-1] == "[DONE]"
            assert [t for e in events[:-1] for c in e["choices"] for t in c["token_ids"]] == want[PROMPTS[1]]
            assert h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": -1}).status_code \
                == 400
            # each scrape reaches one replica; every sample names it, so no series goes backwards between scrapes
            seen: dict[str, float] = {}
            labels: set[str] = set()
            for _ in range(6):
                for fam in text_string_to_metric_families(h.get("/metrics").text):
                    for smp in fam.samples:
                        assert smp.labels.get("replica"), smp
                        if smp.name == "eagle_requests_total":
                            key = repr(sorted(smp.labels.items()))
                            assert smp.value >= seen.get(key, 0), (key, smp.value, seen.get(key))
                            seen[key] = smp.value
                            labels.add(smp.labels["replica"])
        print(f"\nRay Serve: {len(results)} requests, answered by {sorted(replicas)}; /metrics from replicas "
              f"{sorted(labels)}")
    finally:
        serve.shutdown()
        ray.shutdown()

