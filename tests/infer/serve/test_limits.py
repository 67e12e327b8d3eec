"""The server under pressure: a storm of clients that leave mid-stream frees every row and page,
a full queue answers 429 with Retry-After, a request that fails inside the engine fails alone,
and a shutdown (what SIGTERM triggers) lets the streams in flight finish before the engine
stops."""

import concurrent.futures
import json
import signal
import threading
import time

import httpx2 as httpx
import pytest

from infer.serve.grammar import Constraint, Grammars
from tests.infer.serve import tiny

LONG = {"model": "tiny", "prompt": "a", "max_tokens": 120, "temperature": 1.0, "stream": True}


def wait_for(condition, what: str, seconds: float = 60.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def first_line_then_leave(url: str, seed: int) -> str:
    with httpx.stream("POST", url + "/completions", json={**LONG, "seed": seed}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                return line  # leaving the block closes the connection mid-stream


def test_a_disconnect_storm_frees_every_row_and_page(server):
    """20 clients (4 rows + 16 waiting, the queue's limit) each read one chunk of a 120-token
    stream and hang up. Served to the end, the 20 streams would take >= 20 * 120 / 4 = 600
    steps; cancelled at the next step they take far fewer, and the pool ends with no page held."""
    engine = server.app.state.worker.engine
    steps = engine.steps
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        lines = list(pool.map(first_line_then_leave, [server.url] * 20, range(20)))
    assert all(line.startswith("data: {") for line in lines)
    wait_for(lambda: server.app.state.worker.load == 0, "every request to end")
    wait_for(lambda: not engine.busy, "the engine to go idle")
    assert engine.pool.in_use == 0 and all(row is None for row in engine.rows)
    assert engine.steps - steps < 600 // 2


def test_a_full_queue_answers_429_with_retry_after(server, monkeypatch):
    """With the engine held still, 4 rows + 2 waiting take 6 requests; the 7th is refused at
    once; once the engine moves again all 6 are served."""
    worker, gate = server.app.state.worker, threading.Event()
    step = worker.engine.step
    monkeypatch.setattr(worker.engine, "step", lambda: (gate.wait(), step()))
    monkeypatch.setattr(worker, "max_waiting", 2)
    body = {**LONG, "stream": False, "max_tokens": 8}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        accepted = [pool.submit(httpx.post, server.url + "/completions", json=body, timeout=60)
                    for _ in range(6)]  # fmt: skip
        wait_for(lambda: worker.load == 6, "six requests in flight")
        refused = httpx.post(server.url + "/completions", json=body)
        gate.set()
        assert [r.result().status_code for r in accepted] == [200] * 6
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert "6 requests in flight, at most 4 running + 2 waiting" in refused.json()["error"][
        "message"]  # fmt: skip


class BrokenConstraint(Constraint):
    """A constraint that fails on the engine's thread (as a bug in a grammar would)."""

    def __init__(self):
        pass

    def allowed(self):
        raise RuntimeError("this grammar is broken")

    def consume(self, tokens):
        pass


class Broken(Grammars):
    def __init__(self):
        pass

    def grammar(self, response_format, *, regex=None, lark=None):
        return "any"

    def constraint(self, grammar):
        return BrokenConstraint()


def test_a_failing_request_fails_alone(server):
    generations = server.app.state.generations
    saved, generations._grammars = generations._grammars, Broken()
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            broken = pool.submit(httpx.post, server.url + "/completions", timeout=60, json={
                "model": "tiny", "prompt": "a", "max_tokens": 5, "guided_regex": "x"})  # fmt: skip
            fine = pool.submit(httpx.post, server.url + "/completions", timeout=60, json={
                "model": "tiny", "prompt": "a", "max_tokens": 30, "temperature": 0})  # fmt: skip
            assert broken.result().status_code == 500
            assert "this grammar is broken" in broken.result().json()["error"]["message"]
            assert fine.result().status_code == 200
            assert len(fine.result().json()["choices"][0]["text"]) > 0
    finally:
        generations._grammars = saved
    health = httpx.get(server.url.removesuffix("/v1") + "/health")
    assert health.status_code == 200


def test_shutdown_drains_the_streams_in_flight():
    """uvicorn's SIGTERM handler (called as the signal would call it) stops taking connections;
    the three streams already going (held still across the signal, so they generate after it)
    run to their last token and [DONE]; then the engine's thread ends."""
    running = tiny.Running(
        tiny.make_app(tiny.engine(), tiny.tokenizer(), name="tiny", max_waiting=16)
    )
    results, started = [None] * 3, threading.Barrier(4)

    def stream(i: int) -> None:
        body = {**LONG, "seed": i, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", running.url + "/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            started.wait()
            results[i] = [first, *(line for line in lines if line.startswith("data:"))]

    worker, go = running.app.state.worker, threading.Event()
    go.set()
    step = worker.engine.step
    worker.engine.step = lambda: (go.wait(), step())
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    started.wait()
    go.clear()  # the engine holds still while the server is told to stop
    running.server.handle_exit(signal.SIGTERM, None)
    time.sleep(1.0)  # sse-starlette looks for a shutdown every 0.5 s
    assert worker.load > 0  # so generation goes on after the signal
    go.set()
    for thread in threads:
        thread.join()
    running.thread.join()
    for lines in results:  # a cut stream would miss its finish reason, usage and [DONE]
        assert lines[-1] == "data: [DONE]"
        *chunks, usage = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert usage["usage"]["completion_tokens"] >= len(chunks) - 1
    assert not running.app.state.worker._thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(running.url + "/models")
