"""A graceful drain through a real tritonserver and the OpenAI API: on the model's unload and
on SIGINT (what `make serve` makes of SIGTERM), readiness turns false, new requests are refused,
open ones finish with exact token counts until drain_timeout_seconds, the rest end with an
error naming it, and no K/V block is left."""
from __future__ import annotations

import json
import threading

import httpx2 as httpx  # the HTTP client the openai package is built on
import pytest

from benchmarks.servers import Frontend, Server
from client.triton_client import StreamingClient

from conftest import write_model
from helpers import COUNTED, assert_no_leak, streamed_tokens, wait_until

pytestmark = pytest.mark.server  # slow group: a real tritonserver

DRAIN_SECONDS = 20  # long enough for "short" to finish on a machine that stalls for seconds


def _greedy(max_tokens: int) -> dict:
    return {"temperature": "0", "max_tokens": str(max_tokens), "ignore_eos": "true"}


def _openai_stream(url: str, out: list) -> None:
    """An OpenAI completion streamed raw: its events' text, whatever ends it."""
    body = {"model": "orca", "prompt": "An endless tale", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            out.append(line)


def test_a_drain_on_unload_and_on_interrupt(tmp_path, default_model):
    repository = tmp_path / "models"
    write_model(repository, "orca", {"drain_timeout_seconds": str(DRAIN_SECONDS), "kv_cache_tokens": "2048"})
    s = Server(tmp_path, repository, ["--exit-timeout-secs=30", "--model-control-mode=explicit", "--load-model=orca"])
    frontend = None
    try:
        s.wait_ready()
        frontend = Frontend(tmp_path, s.grpc_url, args=["--model", "orca"])
        frontend.wait_ready()
        c = StreamingClient(s.grpc_url)
        endless, short = (c.send(p, sampling=_greedy(n), flags=COUNTED)
                          for p, n in (("Endless tale", 2000), ("Short tale", 24)))
        events: list[str] = []
        openai_stream = threading.Thread(target=_openai_stream, args=(frontend.url, events))
        openai_stream.start()
        wait_until(lambda: c._results[endless].responses and c._results[short].responses and len(events) > 2,
                   60, "every stream to start")
        # Triton's unload returns once the model has ended (each open stream has): on a thread.
        unload = threading.Thread(target=s.http, args=("/v2/repository/models/orca/unload", b"{}"))
        unload.start()
        wait_until(lambda: s.http("/v2/models/orca/ready")[0] != 200, 60, "the model not ready")
        wait_until(lambda: httpx.get(frontend.url + "/health/ready").status_code == 503, 60, "the API not ready")
        with StreamingClient(s.grpc_url) as late:
            refused = late.generate("Too late", sampling=_greedy(4), timeout=60)
        new_openai = httpx.post(frontend.url + "/v1/completions", json={"model": "orca", "prompt": "Too late"},
                                timeout=60)
        results = {name: c.wait(i, timeout=120) for name, i in (("short", short), ("endless", endless))}
        openai_stream.join(120)
        assert_no_leak(s)  # the model's metrics last until its last client stream closes
        c.close()
        unload.join(120)

        assert refused.error == "Request for unknown model: 'orca' has no available versions"  # Triton's
        assert new_openai.status_code == 503 and new_openai.headers["retry-after"] == "1"
        assert (results["short"].error, streamed_tokens(results["short"])) == (None, 24)
        drained = f"the server is draining: the request did not finish within drain_timeout_seconds {DRAIN_SECONDS}"
        assert results["endless"].error == drained
        assert 0 < streamed_tokens(results["endless"]) < 2000
        errors = [json.loads(e[6:])["error"] for e in events if e.startswith("data: {\"error\"")]
        assert [e["message"] for e in errors] == [drained]

        # SIGINT (Ctrl+C, or make serve's SIGTERM): the same drain; a second one ends what is open.
        assert s.http("/v2/repository/models/orca/load", b"{}")[0] == 200
        c = StreamingClient(s.grpc_url)
        endless = c.send("Endless tale", sampling=_greedy(2000))
        wait_until(lambda: c._results[endless].responses, 60, "the stream to start")
        s.terminate()
        wait_until(lambda: not s.is_ready(), 60, "the server not ready")
        seen = len(c._results[endless].responses)
        wait_until(lambda: len(c._results[endless].responses) > seen + 3, 60, "the stream to go on")
        s.terminate()
        assert c.wait(endless, timeout=60).error == "the server is shutting down"
        c.close()
    finally:
        if frontend is not None:
            frontend.stop()
        s.stop()
