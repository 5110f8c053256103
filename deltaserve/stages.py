"""`up --layer-split`: the model's stages as `deltaserve executor --layers ...` processes on this machine, one per
local GPU in turn (gloo between stages that share a GPU, NCCL otherwise), or on the CPU (gloo)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from deltaserve.flags import env_name
from deltaserve.logs import get_logger
from deltaserve.trust import Trust
from executor_svc.config import ExecutorConfig
from protos.auth import SERVICE
from protos.layer_split import EXIT_GROUP_LOST, split_layers

log = get_logger("deltaserve.stages")
STAGE_POLL_S = 0.5  # how often `up` looks whether a stage process ended
STOP_GRACE_S = 30.0  # for every stage together, then the rest are killed
START_LOSS_S = 1.0  # how long a failed start-up step gives the stages to be seen ended (StageWatch.starting)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One stage process: its layers, device and the group's backend."""

    rank: int
    layers: tuple[int, int]
    device: str
    backend: str


def plan_stages(num_layers: int, split: str, device: str, gpus: int) -> list[StagePlan]:
    """The stages of `split` (N, or cut points) over this machine: on CUDA stage r on cuda:(r mod gpus), NCCL
    when every stage has a GPU of its own, else gloo (NCCL refuses two ranks on one device); on the CPU
    gloo."""
    ranges = split_layers(num_layers, split)
    if len(ranges) < 2:
        raise ValueError(f"--layer-split {split!r} makes one stage: run without it")
    cuda = device.startswith("cuda") or (device == "auto" and gpus > 0)
    if not cuda:
        return [StagePlan(rank, r, "cpu", "gloo") for rank, r in enumerate(ranges)]
    if gpus < 1:
        raise ValueError(f"--device {device} but no CUDA device is visible")
    backend = "nccl" if len(ranges) <= gpus else "gloo"
    return [StagePlan(rank, r, f"cuda:{rank % gpus}", backend) for rank, r in enumerate(ranges)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stage_argv(
    config: ExecutorConfig,
    stage: StagePlan,
    stages: int,
    port: int,
    rendezvous: str,
    metrics_port: int | None = None,
) -> list[str]:
    """`deltaserve executor` for one stage, with `up`'s model and serving settings (its metrics on loopback's
    `metrics_port` where given)."""
    argv = [sys.executable, "-m", "deltaserve", "executor", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--device", stage.device, "--dtype", config.dtype, "--weights", config.weights]
    argv += ["--page-size", str(config.page_size)]
    argv += ["--pool-pages", str(config.pool_pages), "--buckets", ",".join(map(str, config.buckets))]
    argv += ["--prefill-buckets", ",".join(map(str, config.prefill_buckets)) or "none"]
    argv += ["--decode-path", config.decode_path, "--shard-layers", str(config.shard_layers)]
    argv += ["--grammar-cache", str(config.grammar_cache)]
    argv += ["--layers", f"{stage.layers[0]}:{stage.layers[1]}", "--stage-rank", str(stage.rank)]
    argv += ["--stages", str(stages), "--stage-group", rendezvous, "--stage-backend", stage.backend]
    argv.append("--stop-on-stdin-close")  # `up` holds the pipe's other end (stage_processes)
    if config.model:
        argv += ["--model", config.model]
    if config.max_seq_len:
        argv += ["--max-seq-len", str(config.max_seq_len)]
    if config.state_slots is not None:  # a hybrid's: every stage holds as many (the planner's slot numbers)
        argv += ["--state-slots", str(config.state_slots)]
    if config.row_check:
        argv.append("--row-check")
    if config.cache:
        argv += ["--cache", config.cache]
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    return argv


class StageExited(Exception):
    """A stage process of `up` ended: its group is lost (a process group takes no restarted rank back)."""


def exit_word(status: int) -> str:
    """A Popen return code in words: a negative one is the signal that killed the process."""
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-status).name}"
        return f"was killed by signal {-status}"
    return f"exited with status {status}"


@dataclass(frozen=True, slots=True)
class StageAddresses:
    """Where the stages listen, in rank order: their step API, and their metrics where asked for; and their
    processes, to see one end."""

    executors: list[str]
    metrics: list[str]
    plans: list[StagePlan]
    processes: list[subprocess.Popen]

    def exited(self) -> StageExited | None:
        """A stage whose process has ended, or None while every one runs: one that ended of itself before one
        that ended because its group was lost (it followed: the other is the cause), then by rank."""
        ended = [
            (status == EXIT_GROUP_LOST, stage.rank, stage, process.pid, status)
            for stage, process in zip(self.plans, self.processes, strict=True)
            if (status := process.poll()) is not None
        ]
        if not ended:
            return None
        _, _, stage, pid, status = min(ended, key=lambda e: e[:2])
        layers = f"{stage.layers[0]}:{stage.layers[1]}"
        return StageExited(
            f"stage {stage.rank} (layers {layers}, pid {pid}) {exit_word(status)}; its group is lost, so `up` "
            "stops: start it again"
        )


def _stop(processes: list[subprocess.Popen], grace_s: float) -> None:
    """Closes each stage's standard input (its stop: it ignores the stop signals), waits `grace_s` in all for
    them to end, and kills those still running."""
    for process in processes:
        with contextlib.suppress(OSError):  # a stage already gone
            process.stdin.close()  # type: ignore[union-attr]
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def stage_processes(
    config: ExecutorConfig,
    split: str,
    trust: Trust,
    metrics: bool = False,
    log_level: str = "info",
    log_json: bool | None = None,
):
    """Starts the stages (their logs on this process's stderr, at `up`'s level and format) and yields their
    StageAddresses; stops them on exit. Each stage is a process of its own, so its metrics have a port of
    their own (on loopback)."""
    import torch

    from executor_svc.models.loader import layer_count
    from protos.model_files import resolve_model_path

    if trust.executor_server.tls is not None:
        raise ValueError(
            "--layer-split with TLS: start the stages with `deltaserve executor --layers` instead"
        )
    gpus = torch.cuda.device_count() if config.device != "cpu" else 0
    plans = plan_stages(layer_count(resolve_model_path(config.model)), split, config.device, gpus)
    rendezvous = f"127.0.0.1:{_free_port()}"
    ports = [_free_port() for _ in plans]
    metrics_ports = [_free_port() for _ in plans] if metrics else [None] * len(plans)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTASERVE_")}
    env[env_name("--log-level")] = log_level
    if log_json is not None:
        env[env_name("--log-json")] = "1" if log_json else "0"
    if trust.cache_link.api_key:  # up's own service key for its cache, never on a command line
        env[env_name("--cache-api-key")] = trust.cache_link.api_key
    keys_file = None
    processes: list[subprocess.Popen] = []
    try:  # from the key file's creation on: it goes however the start fails
        if trust.executor_link.api_key:  # the stages take up's own service key alone, in a file only it reads
            keys_file = tempfile.NamedTemporaryFile("w", prefix="deltaserve-stage-keys-", suffix=".txt")
            keys_file.write(f"{trust.executor_link.api_key} {SERVICE}\n")
            keys_file.flush()
            env[env_name("--api-keys")] = keys_file.name
        for stage, port, metrics_port in zip(plans, ports, metrics_ports, strict=True):
            # A session of its own: the terminal's Ctrl-C to `up`'s process group must not stop the stages
            # before `up` has drained through them; `up` stops them by closing their standard input, which
            # also ends when `up` dies, however, so no stage outlives it.
            processes.append(
                subprocess.Popen(
                    stage_argv(config, stage, len(plans), port, rendezvous, metrics_port),
                    env=env,
                    stdin=subprocess.PIPE,
                    start_new_session=True,
                )
            )
            log.info(  # its pid: a stage is a process to look at or to signal
                "starting stage",
                rank=stage.rank,
                layers=f"{stage.layers[0]}:{stage.layers[1]}",
                device=stage.device,
                pid=processes[-1].pid,
            )
        yield StageAddresses(
            [f"127.0.0.1:{port}" for port in ports],
            [f"127.0.0.1:{port}" for port in metrics_ports if port is not None],
            plans,
            processes,
        )
    finally:
        _stop(processes, STOP_GRACE_S)
        if keys_file is not None:
            keys_file.close()  # deletes it


def start_stages(
    servers: contextlib.AsyncExitStack,
    config: ExecutorConfig,
    args: argparse.Namespace,
    metrics: bool,
    stop: asyncio.Event,
) -> StageWatch:
    """`up --layer-split`'s stages (stage_processes) and the watch over them, both stopped with `servers`:
    from here on, a stage's end is `up`'s (StageExited)."""
    stages = servers.enter_context(
        stage_processes(config, args.layer_split, args.trust, metrics, args.log_level, args.log_json)
    )
    watch = StageWatch(stages, stop)
    servers.callback(watch.close)
    return watch


class StageWatch:
    """`up`'s watch over its stage processes, from their start until `up` stops them: the first to end sets
    `stop` (`up` cannot serve without it, nor restart it into the group), and `up` ends with its StageExited
    however far it got: starting, serving or draining."""

    def __init__(self, stages: StageAddresses, stop: asyncio.Event) -> None:
        self.stages = stages
        self._lost: StageExited | None = None
        self._task = asyncio.create_task(self._watch(stop))

    def lost(self) -> StageExited | None:
        """The stage process that ended, once one did (looked at now, and logged once)."""
        if self._lost is None and (exited := self.stages.exited()) is not None:
            log.error("stage lost", error=str(exited))
            self._lost = exited
        return self._lost

    async def _watch(self, stop: asyncio.Event) -> None:
        """Until `stop`: looks every STAGE_POLL_S, and sets `stop` once a stage ended."""
        while not stop.is_set():
            if self.lost() is not None:
                stop.set()
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), STAGE_POLL_S)

    def raise_if_lost(self) -> None:
        """Raises the StageExited of a stage that ended (while `up` served, or drained: a signal's stop ends
        the watch, not this look)."""
        if (exited := self.lost()) is not None:
            raise exited

    async def starting(self, work: Awaitable[T]) -> T:
        """`work` (`up`'s start-up, until it listens), unless a stage ends first: then `work` is cancelled
        (the planner's attach would wait for a dead stage for ever, `wait_for_ready`) and the stage's
        StageExited raised; so it is in place of the error `work` fails with where a stage is seen ended
        within START_LOSS_S of it (a dead stage's Describe fails UNAVAILABLE as its process ends)."""
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait((task, self._task), return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and self.lost() is None:  # stopped by a signal: the start goes on, as before
                await asyncio.wait((task,))
        finally:
            if not task.done():  # a stage lost (or `up` cancelled): the start goes no further
                task.cancel()
                await asyncio.wait((task,))
        if not task.cancelled() and task.exception() is not None:
            deadline = time.monotonic() + START_LOSS_S
            while self.lost() is None and time.monotonic() < deadline:
                await asyncio.sleep(STAGE_POLL_S / 10)
        if (exited := self.lost()) is not None:
            raise exited from None if task.cancelled() else task.exception()
        return task.result()

    def close(self) -> None:
        self._task.cancel()


async def starting(watch: StageWatch | None, work: Awaitable[T]) -> T:
    """`work`, `up`'s start-up: under the watch of its stages where it runs some (StageWatch.starting)."""
    return await (work if watch is None else watch.starting(work))


def raise_if_lost(watch: StageWatch | None) -> None:
    """StageWatch.raise_if_lost where `up` runs stages."""
    if watch is not None:
        watch.raise_if_lost()
