"""`python -m tests.up_fault up --layer-split ...`: deltaserve's CLI with stage 1 of `up` (UP_FAULT_STAGE)
SIGKILLed, and reaped, at a point of `up`'s own (UP_FAULT_KILL_STAGE_AT) before `up` goes on, so a window of a
few milliseconds is hit every time: `seen` once `up` saw every stage serve, before its planner attaches to the
group; `describe` once the planner attached, before `up` describes the group and says it listens; `drain` as
its drain begins (after a stop signal). UP_FAULT_SIGNAL=SIGSTOP freezes the stage there instead. Its log line
`fault: stage killed` names the stage's pid."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from deltaserve import serve, stages
from deltaserve.cli import main
from deltaserve.logs import get_logger

log = get_logger("tests.up_fault")
POINT = os.environ["UP_FAULT_KILL_STAGE_AT"]
RANK = int(os.environ.get("UP_FAULT_STAGE", "1"))
# SIGKILL (reaped), or SIGSTOP: the stage frozen, alive to its sockets and answering nothing
SIGNAL = signal.Signals[os.environ.get("UP_FAULT_SIGNAL", "SIGKILL")]
_started: list[stages.StageAddresses] = []
_seen: list[str] = []


def _kill_stage(point: str) -> None:
    if point != POINT:
        return
    process = _started[0].processes[RANK]
    process.send_signal(SIGNAL)
    if SIGNAL is signal.SIGKILL:
        process.wait()  # dead before `up` goes on (and reaped: its return code stays for `up` to read)
    log.info("fault: stage killed", point=point, rank=RANK, pid=process.pid, signal=SIGNAL.name)


_stage_processes = stages.stage_processes


@contextlib.contextmanager
def _recorded_stage_processes(*args, **kwargs):
    with _stage_processes(*args, **kwargs) as started:
        _started.append(started)
        yield started


_wait_for_executor = serve.wait_for_executor


async def _wait_then_kill(addr, stop, security=None):
    served = await _wait_for_executor(addr, stop, security)
    _seen.append(addr)
    if served and _started and len(_seen) == len(_started[0].executors):
        _kill_stage("seen")
    return served


_describe_executor = serve._describe_executor


async def _kill_then_describe(addr, security=None):
    _kill_stage("describe")
    return await _describe_executor(addr, security)


_drain_planner = serve._drain_planner


async def _kill_then_drain(planner, drain_timeout_s):
    _kill_stage("drain")
    return await _drain_planner(planner, drain_timeout_s)


stages.stage_processes = _recorded_stage_processes
if hasattr(serve, "stage_processes"):  # imported by name (before StageWatch)
    serve.stage_processes = _recorded_stage_processes
serve.wait_for_executor = _wait_then_kill
serve._describe_executor = _kill_then_describe
serve._drain_planner = _kill_then_drain

if __name__ == "__main__":
    sys.exit(main())
