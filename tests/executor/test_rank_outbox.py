"""A rank's loop (`executor/rank_process._serve`) with its outbox: it launches step N+1 before step N's
output reaches the host, sends every step's messages in launch order, and turns an output that fails
on its way to the host into an error naming the rank. A gated worker stands in for the device: each
step's output waits for the test to open its gate."""

from __future__ import annotations

import queue
import threading

import pytest

from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.executor.rank_outbox import RankOutbox
from deltaserve.executor.rank_process import OUTPUT_FAILED, SHUTDOWN, RankReady, _serve
from deltaserve.worker.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput

WAIT_S = 30.0  # a bound on waits that return at once unless the code under test is broken


class RecordingChannels:
    """A rank's channels that keep what is sent."""

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, kind: str, *payload) -> None:
        self.sent.append((kind, *payload))


class GatedWorker:
    """Step k samples token k for request "r<k>" once gates[k] is set (steps in `ready_steps` at once)."""

    def __init__(self, ready_steps: tuple[int, ...] = (), failing_steps: tuple[int, ...] = ()) -> None:
        self.launched: list[int] = []
        self.gates: dict[int, threading.Event] = {}
        self._launch = threading.Condition()
        self.ready_steps, self.failing_steps = ready_steps, failing_steps

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> AsyncModelRunnerOutput:
        assert non_block, "a rank must not wait for the device inside execute_model"
        step = scheduler_output.step_id
        output = ModelRunnerOutput([f"r{step}"], [step])
        gate = self.gates[step] = threading.Event()
        with self._launch:
            self.launched.append(step)
            self._launch.notify_all()
        if step in self.ready_steps:
            return AsyncModelRunnerOutput.ready(output)

        def resolve() -> ModelRunnerOutput:
            assert gate.wait(WAIT_S)
            if step in self.failing_steps:
                raise RuntimeError(f"device fault in step {step}")
            return output

        return AsyncModelRunnerOutput(resolve)

    def wait_launched(self, n: int) -> bool:
        """Whether `n` steps were launched within WAIT_S."""
        with self._launch:
            return self._launch.wait_for(lambda: len(self.launched) >= n, WAIT_S)


def _ready() -> RankReady:
    return RankReady(rank=3, pp_rank=0, tp_rank=0, pid=0, layer_range=(0, 1), kv_spec=None, state_spec=None,
                     cache_bytes=0, device="cpu", dtype="float32")


def _start(worker: GatedWorker) -> tuple[queue.Queue, RecordingChannels, RankOutbox, threading.Thread, list]:
    """`_serve` in a thread, as the output rank; returns its inbox, channels, outbox, thread and the
    exception it ended with (a list, empty while none)."""
    inbox: queue.Queue = queue.Queue()
    channels = RecordingChannels()
    outbox = RankOutbox(channels, on_failure=lambda text: inbox.put((OUTPUT_FAILED, text)))
    raised: list[BaseException] = []

    def serve() -> None:
        try:
            _serve(worker, _ready(), inbox, outbox, is_output_rank=True)
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return inbox, channels, outbox, thread, raised


def test_next_step_is_launched_before_the_previous_output_is_on_the_host():
    worker = GatedWorker()
    inbox, channels, outbox, thread, raised = _start(worker)
    inbox.put(("step", SchedulerOutput(step_id=1)))
    inbox.put(("step", SchedulerOutput(step_id=2)))
    assert worker.wait_launched(2)
    assert channels.sent == []  # neither output is on the host yet
    worker.gates[2].set()
    worker.gates[1].set()
    inbox.put(SHUTDOWN)
    thread.join(WAIT_S)
    outbox.close()
    assert not raised
    assert [(m[0], m[1], m[2].sampled_token_ids, m[4]) for m in channels.sent] == [
        ("output", 1, [1], 1), ("output", 2, [2], 2)]
    busy = [m[3] for m in channels.sent]
    assert 0 < busy[0] <= busy[1]


def test_a_ready_output_waits_behind_one_still_queued():
    worker = GatedWorker(ready_steps=(2,))
    inbox, channels, outbox, thread, raised = _start(worker)
    inbox.put(("step", SchedulerOutput(step_id=1)))
    inbox.put(("step", SchedulerOutput(step_id=2)))
    inbox.put(("sync", 7))
    assert worker.wait_launched(2)
    worker.gates[1].set()
    inbox.put(SHUTDOWN)
    thread.join(WAIT_S)
    outbox.close()
    assert not raised
    assert [m[:2] for m in channels.sent] == [("output", 1), ("output", 2), ("synced", 7)]


def test_an_output_that_fails_on_its_way_to_the_host_stops_the_rank_naming_it():
    worker = GatedWorker(failing_steps=(1,))
    inbox, channels, outbox, thread, raised = _start(worker)
    inbox.put(("step", SchedulerOutput(step_id=1)))
    assert worker.wait_launched(1)
    worker.gates[1].set()
    thread.join(WAIT_S)
    outbox.close()
    assert channels.sent == []
    with pytest.raises(RuntimeError, match=r"rank 3: a step's output failed[\s\S]*device fault in step 1"):
        raise raised[0]
