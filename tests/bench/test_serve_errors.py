"""Failures never crash `deltaserve bench serve`: a server answering 500s and cutting streams short
is counted; an unreachable server or a missing vocabulary is an exit code naming the flag; Ctrl-C
writes what was measured."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from deltaserve.bench.serve.report import ProgressBar
from deltaserve.cli import main


def _flaky_app() -> FastAPI:
    """Request n (counted across the run): n % 4 == 1 is a 500, n % 4 == 3 a stream cut before [DONE],
    the rest a stream of max_tokens one-token chunks and a usage without cached_tokens."""
    app = FastAPI()
    counter = itertools.count()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "flaky", "object": "model", "max_model_len": 1000}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        n = next(counter)
        if n % 4 == 1:
            return JSONResponse({"error": {"message": "the engine fell over", "type": "internal"}}, status_code=500)

        async def events():
            for i in range(body["max_tokens"]):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n"
                if n % 4 == 3 and i == 1:
                    return
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def flaky_server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_flaky_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:  # waits for startup; nothing is timed
        assert thread.is_alive(), "the flaky server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join()


def test_server_errors_are_counted_with_their_messages(flaky_server, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["bench", "serve", "--base-url", flaky_server + "/v1", "--workload", "random", "--concurrency", "1,2",
                 "--num-requests", "8", "--random-input-len", "20", "--random-output-len", "4", "--vocab-size", "100",
                 "--no-progress", "--out", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    for level in doc["levels"]:
        assert (level["completed"], level["failed"], level["cancelled"]) == (4, 4, 0)
        assert level["errors"] == [{"message": "HTTP 500: the engine fell over", "count": 2},
                                   {"message": "the stream ended before [DONE]", "count": 2}]
        assert (level["input_tokens"], level["output_tokens"]) == (4 * 20, 4 * 4)
        assert level["prefix_cache"]["usage_hit_rate"] is None  # no cached_tokens in its usage
        assert level["prefix_cache"]["metrics_hit_rate"] is None  # no /metrics
    printed = capsys.readouterr().out
    assert "C=2: 2 x HTTP 500: the engine fell over" in printed


def test_duration_ends_each_level(flaky_server, tmp_path):
    out = tmp_path / "r.json"
    code = main(["bench", "serve", "--base-url", flaky_server, "--workload", "agentic", "--concurrency", "1,3",
                 "--duration", "0.3", "--agentic-system-len", "10", "--agentic-tools-len", "10",
                 "--agentic-user-len", "10", "--agentic-tool-result-len", "5:10", "--agentic-answer-len", "2",
                 "--vocab-size", "100", "--no-progress", "--out", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["requests_per_level"] == [None, None]
    for level in doc["levels"]:
        assert level["num_sent"] >= 1 and level["completed"] + level["failed"] == level["num_sent"]
        assert level["workload_stats"]["answers_from_server"] == 0  # it returns no token ids: synthetic answers


def test_setup_errors_name_the_flag(flaky_server, capsys):
    args = ["bench", "serve", "--workload", "random", "--num-requests", "1", "--no-progress"]
    assert main([*args, "--base-url", flaky_server]) == 2
    assert "pass --vocab-size" in capsys.readouterr().err
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    assert main([*args, "--base-url", f"http://127.0.0.1:{port}", "--vocab-size", "100"]) == 2
    assert f"--base-url http://127.0.0.1:{port}: GET /v1/models failed" in capsys.readouterr().err
    assert main([*args, "--base-url", flaky_server, "--workload", "trace"]) == 2
    assert "--workload trace needs --trace FILE" in capsys.readouterr().err


def test_ctrl_c_writes_what_was_measured(tiny_server, tmp_path, monkeypatch):
    done = []
    request_done = ProgressBar.request_done

    def interrupt_after_two(self, record):
        request_done(self, record)
        done.append(record)
        if len(done) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ProgressBar, "request_done", interrupt_after_two)
    out = tmp_path / "r.json"
    code = main(["bench", "serve", "--base-url", tiny_server.url, "--workload", "random", "--concurrency", "2,4",
                 "--num-requests", "40", "--random-input-len", "32", "--random-output-len", "32", "--out", str(out)])
    assert code == 130
    doc = json.loads(out.read_text())
    assert doc["interrupted"] and len(doc["levels"]) == 1 and doc["levels"][0]["interrupted"]
    level = doc["levels"][0]
    assert level["completed"] >= 2 and level["num_sent"] < 40
    assert level["completed"] + level["failed"] + level["cancelled"] == level["num_sent"]
    assert level["input_tokens"] == 32 * level["completed"]
