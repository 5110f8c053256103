"""Stages of a layer split for the tests: each a `deltaserve executor --layers ...` process on the CPU (gloo),
and a planner in this process attached to them as one group, over real gRPC."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from planner_svc.config import PlannerConfig, SchedulingConfig
from planner_svc.server import start_planner_server
from tests.cli_helpers import Serving, free_port
from tests.conftest import Stack

STAGE_FLAGS = ("--device", "cpu", "--dtype", "float32", "--pool-pages", "400", "--buckets", "1,2,4,8")


class StageGroup:
    """The stages of one split, as processes; `cache` the cache service they park to (None: none), except the
    ranks in `without_cache`; `ports` to restart a group where the planner knows it (default: free ones)."""

    def __init__(
        self,
        log_dir: Path,
        ranges: list[tuple[int, int]],
        cache: str | None = None,
        *,
        flags: tuple[str, ...] = STAGE_FLAGS,
        ports: list[int] | None = None,
        without_cache: tuple[int, ...] = (),
    ) -> None:
        rendezvous = f"127.0.0.1:{free_port()}"
        self.ports = ports or [free_port() for _ in ranges]
        self.stages = []
        for rank, ((begin, end), port) in enumerate(zip(ranges, self.ports, strict=True)):
            argv = ["executor", "--port", str(port), *flags, "--row-check"]
            argv += ["--layers", f"{begin}:{end}", "--stage-rank", str(rank), "--stages", str(len(ranges))]
            argv += [
                "--stage-group",
                rendezvous,
                *(["--cache", cache] if cache and rank not in without_cache else []),
            ]
            self.stages.append(Serving(log_dir / f"stage{rank}-{begin}-{end}-{rendezvous[10:]}.log", *argv))

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    def wait_listening(self, timeout: float = 180) -> None:
        for stage in self.stages:
            stage.wait_listening(timeout)

    def kill(self, rank: int) -> None:
        os.kill(self.stages[rank].process.pid, signal.SIGKILL)

    def stop(self) -> None:
        for stage in self.stages:
            if stage.process.poll() is None:
                stage.process.kill()
            stage.process.wait(30)


async def start_group_planner(
    addresses: list[str], cache: str | None = None, **config
) -> tuple[Stack, object]:
    """A planner (row check on) attached to one stage group; the Stack and its server."""
    planner = PlannerConfig(
        executor_groups=[addresses],
        cache=cache,
        scheduling=SchedulingConfig(row_check=True, prefill_token_budget=512),
        **config,
    )
    server = await start_planner_server(planner, port=0)
    return Stack(f"127.0.0.1:{server.port}", server.servicer, None), server
