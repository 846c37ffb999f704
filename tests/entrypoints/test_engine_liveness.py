"""The liveness pieces in one process: heartbeats, the front end's watch, the core's view of its front
ends, and what a front end answers once its engine is gone."""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
import time

import pytest
import zmq
import zmq.asyncio
from fastapi.testclient import TestClient

from deltaserve.config.engine_config import EngineConfig
from deltaserve.engine.core import EngineCoreRequest
from deltaserve.engine.core_proc import EngineCoreProc, heartbeat_address
from deltaserve.engine.engine_watch import EngineWatch, WatchSettings
from deltaserve.engine.heartbeat import FrontendRegistry, core_heartbeat
from deltaserve.entrypoints.openai.api_server import FrontendSettings, build_app
from deltaserve.sampling_params import SamplingParams


def test_registry_names_front_ends_that_went_silent():
    registry = FrontendRegistry(silent_after_s=5.0)
    registry.seen(b"a", now=100.0)
    registry.seen(b"b", now=103.0)
    assert registry.silent({b"a", b"b"}, now=104.0) == []
    assert registry.silent({b"a", b"b"}, now=106.0) == [b"a"]
    assert registry.silent({b"a"}, now=107.0) == []  # forgotten once reported: one abort, not one per step
    assert registry.silent({b"never-seen"}, now=200.0) == []


async def _watch(tmp_path, settings: WatchSettings, run_s: float, gone: list[str]) -> str | None:
    """An EngineWatch over `settings` for `run_s`; its problem() at the end (reasons go to `gone`)."""
    context = zmq.asyncio.Context()
    request_socket = context.socket(zmq.DEALER)
    request_socket.connect(f"ipc://{tmp_path}/core.sock")
    watch = EngineWatch(context, request_socket, settings, gone.append)
    watch.start()
    await asyncio.sleep(run_s)
    problem = watch.problem()
    await watch.stop()
    request_socket.close(0)
    context.term()
    return problem


def _watch_core(tmp_path, busy_for_s: float, stuck_after_s: float) -> tuple[str | None, list[str]]:
    """A real core heartbeat (reporting `busy_for_s`) watched for 0.5 s; (problem(), gone reasons)."""
    address = f"ipc://{tmp_path}/heartbeat.sock"
    beat_context = zmq.Context()
    beat = core_heartbeat(beat_context, address, lambda: busy_for_s, interval_s=0.05)
    beat.start()
    gone: list[str] = []
    try:
        return asyncio.run(_watch(tmp_path, WatchSettings(address, stuck_after_s=stuck_after_s), 0.5, gone)), gone
    finally:
        beat.stop()
        beat_context.term()


def test_a_busy_core_that_beats_is_healthy(tmp_path):
    problem, gone = _watch_core(tmp_path, busy_for_s=2.0, stuck_after_s=30.0)
    assert problem is None and gone == []


def test_a_core_in_one_step_for_too_long_is_reported_stuck(tmp_path):
    problem, gone = _watch_core(tmp_path, busy_for_s=45.0, stuck_after_s=30.0)
    assert problem is not None and "no progress for 45" in problem
    assert gone == []  # stuck is not gone: it may yet finish the step


def test_a_silent_core_is_gone(tmp_path):
    gone: list[str] = []
    asyncio.run(_watch(tmp_path, WatchSettings(f"ipc://{tmp_path}/heartbeat.sock", silent_after_s=0.5), 1.5, gone))
    assert len(gone) == 1 and "no heartbeat" in gone[0]


def test_an_orphaned_front_end_notices_its_launcher_is_gone(tmp_path):
    gone: list[str] = []
    settings = WatchSettings(f"ipc://{tmp_path}/heartbeat.sock", launcher_pid=os.getppid() + 1_000_000)
    asyncio.run(_watch(tmp_path, settings, 1.0, gone))
    assert len(gone) == 1 and "launcher" in gone[0]


@pytest.fixture
def core_proc(tmp_path):
    """A real engine core (the random tiny preset) looping in a thread, its front-end timeout 0.5 s."""
    proc = EngineCoreProc(EngineConfig(model="random:tiny", cache_memory="64MiB", max_model_len=1024), f"ipc://{tmp_path}/core.sock",
                          "tiny", log_stats_interval_s=0)
    proc._frontends.silent_after_s = 0.5
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    yield proc
    proc.request_stop()
    thread.join(30)


def test_the_core_aborts_the_requests_of_a_front_end_that_stopped_beating(core_proc, tmp_path):
    context = zmq.Context()
    frontend = context.socket(zmq.DEALER)
    frontend.setsockopt(zmq.ROUTING_ID, b"frontend-test")
    frontend.setsockopt(zmq.LINGER, 0)
    frontend.connect(f"ipc://{tmp_path}/core.sock")
    beats = context.socket(zmq.SUB)
    beats.setsockopt(zmq.SUBSCRIBE, b"")
    beats.connect(heartbeat_address(f"ipc://{tmp_path}/core.sock"))
    try:
        params = SamplingParams(max_tokens=900, ignore_eos=True, temperature=0.0)
        frontend.send(pickle.dumps(("add", EngineCoreRequest("r1", [1, 2, 3], params, 900))))
        deadline = time.monotonic() + 30
        aborted = None
        while time.monotonic() < deadline and aborted is None:  # outputs, then the abort: no heartbeats sent
            if frontend.poll(100):
                message = pickle.loads(frontend.recv())
                if message[0] == "aborted":
                    aborted = message
        assert aborted is not None and aborted[1] == "r1" and "heartbeats" in aborted[2]
        assert beats.poll(2000)  # the core's own heartbeat is published
        assert pickle.loads(beats.recv())[0] == "heartbeat"
        deadline = time.monotonic() + 10
        while core_proc.core.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not core_proc.core.has_unfinished_requests()
        assert core_proc._owners == {}
    finally:
        frontend.close(0)
        beats.close(0)
        context.term()


def test_a_front_end_whose_engine_is_gone_answers_503():
    settings = FrontendSettings(engine_config=EngineConfig(model="random:tiny"), engine_address="ipc:///nonexistent/core.sock",
                                served_model_names=["tiny"])
    with TestClient(build_app(settings)) as client:
        assert client.get("/health").status_code == 200
        client.app.state.engine().mark_dead("the engine core is gone (test)")
        for response in (client.get("/health"), client.get("/ping"),
                         client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})):
            assert response.status_code == 503
            assert "the engine core is gone (test)" in response.json()["error"]["message"]
