"""`up --layer-split` watches its stage processes and owns them (a tiny random Llama on the CPU, each stage a
process): a stage that cannot start, or that dies while serving, stops `up` with status 1 and one line naming
the stage (its group cannot take a restarted rank back, and the stages' ports are internal: a supervisor
restarts `up`); Ctrl-C to `up`'s process group drains through the stages (they run in a session of their own)
and parks the conversation; and no stage outlives `up`, even one SIGKILLed."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_helpers import Serving, deltaserve_json, free_port

UP_START_S = 120  # two stage processes importing torch on a shared 2-core machine


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from tests.hf_reference import hf_tokenizer
    from tests.test_faults_layer_split import tiny_checkpoint

    path = tiny_checkpoint(tmp_path_factory.mktemp("up-stages") / "tiny", "llama3")
    hf_tokenizer().save_pretrained(path)  # `up`'s planner reads its tokenizer from --model
    return path


def _up(
    tmp_path: Path,
    model: str,
    *flags: str,
    own_group: bool = False,
    kill_stage_at: str | None = None,
    fault_signal: str = "SIGKILL",
) -> tuple[Serving, int]:
    """kill_stage_at: stage 1 sent `fault_signal` at that point of `up`'s start or stop (tests/up_fault.py)."""
    port = free_port()
    up = Serving(
        tmp_path / "up.log",
        "up",
        *("--model", model, "--device", "cpu", "--dtype", "float32", "--layer-split", "2"),
        *("--pool-pages", "64", "--buckets", "1,2", "--page-size", "4", "--port", str(port)),
        *flags,
        own_group=own_group,
        module="tests.up_fault" if kill_stage_at else "deltaserve",
        env={"UP_FAULT_KILL_STAGE_AT": kill_stage_at, "UP_FAULT_SIGNAL": fault_signal}
        if kill_stage_at
        else None,
    )
    return up, port


def _listening(up: Serving, port: int) -> None:
    """Up's own listening line (its stages log theirs to the same stderr)."""
    deadline = time.monotonic() + UP_START_S
    while not any(e["event"] == "listening" and e["addr"].endswith(f":{port}") for e in up.events()):
        assert up.process.poll() is None, up.log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"up not listening within {UP_START_S} s"
        time.sleep(0.2)


def _stage_pids(up: Serving) -> list[int]:
    return [e["pid"] for e in up.events() if e["event"] == "starting stage"]


def _gone(pid: int) -> bool:
    """Ended (a zombie no one reaped yet is ended too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _until_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, f"stage processes {pids} still running after {timeout:g} s"
        time.sleep(0.2)


def _error_line(up: Serving) -> str:
    lines = [
        line for line in up.log_path.read_text().splitlines() if line.startswith("deltaserve up: error:")
    ]
    assert len(lines) == 1, up.log_path.read_text()[-3000:]
    return lines[0]


def test_up_stops_with_an_error_when_a_stage_cannot_start(tmp_path, model):
    """It used to wait for the executor forever."""
    up, _ = _up(
        tmp_path, model, "--no-cache", "--decode-path", "host-planned"
    )  # CUDA only: refused on the CPU
    with _killed_after(up):
        code = up.process.wait(UP_START_S)
    assert code == 1
    assert re.fullmatch(
        r"deltaserve up: error: stage [01] \(layers [0-9:]+, pid \d+\) exited with status 1; .*",
        _error_line(up),
    )
    _until_gone(_stage_pids(up), 5)


def test_up_stops_with_an_error_when_a_stage_dies(tmp_path, model):
    """It used to stay up NOT_SERVING forever, and exit 0 when stopped."""
    up, port = _up(tmp_path, model, "--no-cache", "--executor-timeout", "3")
    with _killed_after(up):
        _listening(up, port)
        asked = ("--token-ids", "5,9,11", "--max-tokens", "4", "--addr", f"127.0.0.1:{port}")
        assert len(deltaserve_json("generate", *asked)["token_ids"]) == 4
        pids = _stage_pids(up)
        os.kill(pids[1], signal.SIGKILL)
        code = up.process.wait(60)
    assert code == 1
    assert _error_line(up).startswith(
        f"deltaserve up: error: stage 1 (layers 2:4, pid {pids[1]}) was killed by SIGKILL; "
    )
    _until_gone(pids, 5)


@contextlib.contextmanager
def _killed_after(up: Serving) -> Iterator[None]:
    """`up` killed should the block leave it running (an assertion failed, a wait timed out)."""
    try:
        yield
    finally:
        if up.process.poll() is None:
            up.process.kill()


def _no_traceback(up: Serving) -> None:
    text = up.log_path.read_text()
    assert "Traceback" not in text and not any(e["event"] == "failed" for e in up.events()), text[-3000:]


def _killed_pid(up: Serving) -> int:
    (killed,) = [e for e in up.events() if e["event"] == "fault: stage killed"]
    return killed["pid"]


@pytest.mark.parametrize("point", ["seen", "describe"])
def test_up_stops_with_the_error_when_a_stage_dies_while_it_starts(tmp_path, model, point):
    """Stage 1 SIGKILLed (and reaped) in the window between `up` seeing every stage serve and `up` serving:
    `seen`, before the planner attaches to the group (the attach used to wait for the dead stage forever, a
    SIGTERM too); `describe`, once it attached, before `up` describes the group (it used to fail with a
    traceback)."""
    up, port = _up(tmp_path, model, "--no-cache", kill_stage_at=point)
    with _killed_after(up):
        code = up.process.wait(UP_START_S)
    assert code == 1
    assert _error_line(up).startswith(
        f"deltaserve up: error: stage 1 (layers 2:4, pid {_killed_pid(up)}) was killed by SIGKILL; "
    )
    _no_traceback(up)
    assert not any(e["event"] == "listening" and e["addr"].endswith(f":{port}") for e in up.events())
    _until_gone(_stage_pids(up), 5)


def test_a_stop_signal_ends_up_attaching_to_a_frozen_stage(tmp_path, model):
    """Stage 1 frozen (SIGSTOP) once `up` saw every stage serve: the attach waits on it, and SIGTERM ends `up`
    (it used to wait in the attach for ever once the signal had stopped the stages' watch)."""
    up, _ = _up(tmp_path, model, "--no-cache", kill_stage_at="seen", fault_signal="SIGSTOP")
    with _killed_after(up):
        deadline = time.monotonic() + UP_START_S
        while not any(e["event"] == "fault: stage killed" for e in up.events()):
            assert up.process.poll() is None and time.monotonic() < deadline, up.log_path.read_text()[-3000:]
            time.sleep(0.2)
        pid = _killed_pid(up)
        time.sleep(1.0)  # into the attach, which waits on the frozen stage
        up.process.send_signal(signal.SIGTERM)
        try:
            code = up.process.wait(60)
        finally:
            with contextlib.suppress(ProcessLookupError):  # should `up` not have stopped it
                os.kill(pid, signal.SIGKILL)
    assert code == 0, up.log_path.read_text()[-3000:]


def test_up_stops_with_the_error_when_a_stage_dies_while_it_drains(tmp_path, model):
    """Stage 1 SIGKILLed as `up`'s drain begins (SIGTERM): the conversation is said not parked, and `up` exits
    1 with the line naming the stage, as when one dies while serving; no traceback."""
    cache = ("--cache-dir", str(tmp_path / "snapshots"), "--cache-port", str(free_port()))
    up, port = _up(tmp_path, model, *cache, "--drain-timeout", "5", kill_stage_at="drain")
    with _killed_after(up):
        _listening(up, port)
        asked = ("--token-ids", "5,9,11,7,3", "--max-tokens", "4", "--conversation", "chat")
        deltaserve_json("generate", *asked, "--addr", f"127.0.0.1:{port}")
        up.process.send_signal(signal.SIGTERM)
        code = up.process.wait(90)
    (drained,) = [e for e in up.events() if e["event"] == "drained"]
    assert drained["parked"] == 0 and len(drained["not_parked"]) == 1, up.log_path.read_text()[-3000:]
    assert code == 1
    assert _error_line(up).startswith(
        f"deltaserve up: error: stage 1 (layers 2:4, pid {_killed_pid(up)}) was killed by SIGKILL; "
    )
    _no_traceback(up)
    _until_gone(_stage_pids(up), 5)


def test_the_stage_named_is_the_cause_not_the_one_that_followed_it():
    """A stage killed takes the others down with it (EXIT_GROUP_LOST): the line names the killed one, which a
    poll finds ended beside the others."""
    from types import SimpleNamespace

    from deltaserve.stages import StageAddresses, StagePlan

    plans = [StagePlan(r, (2 * r, 2 * r + 2), "cpu", "gloo") for r in range(3)]

    def stages(*statuses: int | None) -> StageAddresses:
        processes = [SimpleNamespace(pid=100 + r, poll=lambda s=s: s) for r, s in enumerate(statuses)]
        return StageAddresses([], [], plans, processes)  # type: ignore[arg-type]

    assert stages(None, None, None).exited() is None
    assert "stage 2 (layers 4:6, pid 102) was killed by SIGKILL" in str(stages(3, 3, -9).exited())
    assert "stage 1 (layers 2:4, pid 101) exited with status 1" in str(stages(3, 1, None).exited())
    assert "stage 0 (layers 0:2, pid 100) exited with status 3" in str(stages(3, 3, None).exited())


def test_the_start_up_s_own_error_stays_where_no_stage_ended():
    """StageWatch.starting: a start-up step that fails while every stage runs fails as itself (once START_LOSS_S
    showed no stage ended); one waiting when a stage ends is cancelled for the stage's StageExited, and so is one
    that fails as a stage ends; a signal's stop lets the start go on, as before."""
    import asyncio
    from types import SimpleNamespace

    from deltaserve.stages import StageAddresses, StageExited, StagePlan, StageWatch

    plans = [StagePlan(r, (2 * r, 2 * r + 2), "cpu", "gloo") for r in range(2)]
    status: list[int | None] = [None, None]
    processes = [SimpleNamespace(pid=100 + r, poll=lambda r=r: status[r]) for r in range(2)]
    stages = StageAddresses([], [], plans, processes)  # type: ignore[arg-type]
    cancelled = []

    async def fails(error: Exception, then_dies: bool = False) -> None:
        if then_dies:
            asyncio.get_running_loop().call_later(0.2, status.__setitem__, 1, -9)
        raise error

    async def waits(stop: asyncio.Event | None = None) -> str:
        if stop is not None:
            stop.set()  # the signal's
        try:
            await asyncio.sleep(0.3 if stop is not None else 30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return "served"

    async def main() -> None:
        stop = asyncio.Event()
        watch = StageWatch(stages, stop)
        with pytest.raises(OSError, match="port taken"):
            await watch.starting(fails(OSError("port taken")))
        assert await watch.starting(waits(stop)) == "served"
        watch.close()
        watch = StageWatch(stages, asyncio.Event())
        asyncio.get_running_loop().call_later(0.2, status.__setitem__, 1, -9)
        with pytest.raises(StageExited, match=r"stage 1 \(layers 2:4, pid 101\) was killed by SIGKILL"):
            await asyncio.wait_for(watch.starting(waits()), 5)
        assert cancelled == [True]
        watch.close()
        status[1] = None
        watch = StageWatch(stages, asyncio.Event())
        with pytest.raises(StageExited) as raised:
            await watch.starting(fails(ConnectionError("UNAVAILABLE"), then_dies=True))
        assert isinstance(raised.value.__cause__, ConnectionError)
        watch.close()

    asyncio.run(main())


def test_ctrl_c_to_up_drains_through_its_stages(tmp_path, model):
    """The terminal's SIGINT reaches `up`'s whole process group: the stages used to stop with `up`, before its
    drain could park through them."""
    cache = ("--cache-dir", str(tmp_path / "snapshots"), "--cache-port", str(free_port()))
    up, port = _up(tmp_path, model, *cache, "--drain-timeout", "5", own_group=True)
    try:
        _listening(up, port)
        asked = ("--token-ids", "5,9,11,7,3", "--max-tokens", "4", "--conversation", "chat")
        deltaserve_json("generate", *asked, "--addr", f"127.0.0.1:{port}")
        pids = _stage_pids(up)
        os.killpg(up.process.pid, signal.SIGINT)  # Ctrl-C
        code = up.process.wait(90)
    finally:
        if up.process.poll() is None:
            os.killpg(up.process.pid, signal.SIGKILL)
    (drained,) = [e for e in up.events() if e["event"] == "drained"]
    assert (code, drained["parked"], drained["not_parked"]) == (0, 1, []), up.log_path.read_text()[-3000:]
    _until_gone(pids, 5)


def test_no_stage_outlives_up_killed(tmp_path, model):
    """Its stages stop when their standard input, a pipe from `up`, ends: however `up` ends."""
    up, port = _up(tmp_path, model, "--no-cache")
    try:
        _listening(up, port)
        pids = _stage_pids(up)
        up.process.kill()
        up.process.wait(10)
        _until_gone(pids, 30)
    finally:
        for pid in _stage_pids(up):  # only on failure: the test's own orphans
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
