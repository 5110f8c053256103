"""bench/decode.py's arms and their set-up: the arms' names (--arms), the planner's recording link, an Arm
(its planner, linked to an in-process runner or to an executor child), and the trust arms' API key and TLS
certificates."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

from bench.decode_children import ExecutorChild
from bench.in_process import InProcessLink
from bench.step_timeline import ExecutorTimeline, PlannerTimeline, joined
from executor_svc.runner import StepRunner
from planner_svc.config import PlannerConfig
from planner_svc.link import GrpcLink
from planner_svc.server import start_planner_server
from protos import executor_pb2
from protos.auth import parse_keys
from protos.rpc import ChannelSecurity, ServerSecurity, StartedServer
from protos.tls import ClientTLS, ServerTLS

ARMS = ("resident", "host-planned", "resident-inprocess", "resident-auth", "resident-tls")
DEFAULT_ARMS = ARMS[:3]
# The resident gRPC arm with the planner's client API behind an API key (the interceptor's cost), or with TLS
# on the client API and on the planner's link to the executor (TLS's cost).
AUTH_ARM, TLS_ARM = "resident-auth", "resident-tls"
BENCH_KEY = "bench-key-0123456789abcdef"


def arm_list(text: str) -> tuple[str, ...]:
    """--arms: names from ARMS, in ARMS' order."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = names - set(ARMS)
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"arms are {', '.join(ARMS)}; got {text!r}")
    return tuple(arm for arm in ARMS if arm in names)


def in_process(arm: str) -> bool:
    return arm.endswith("-inprocess")


def executor_process(arm: str) -> str:
    return "same" if in_process(arm) else "child"


class RecordingLink:
    """A link that notes the size of the decode plans it sends that write no row, sampler or prefill:
    steady ones (the same rows as the step before) and the others (a new slot list, as requests leave or
    join)."""

    def __init__(self, link) -> None:
        self._link = link
        self.address = link.address
        self.steady_bytes: list[int] = []
        self.slot_change_bytes: list[int] = []
        self.timeline: PlannerTimeline | None = None  # --timeline

    def __getattr__(self, name: str):
        return getattr(self._link, name)

    async def send(self, plan: executor_pb2.StepPlan) -> None:
        if plan.bucket and not (plan.prefill or plan.row_runs or plan.sampler_slots):
            (self.slot_change_bytes if plan.slots else self.steady_bytes).append(plan.ByteSize())
        if self.timeline is not None:
            self.timeline.sent(plan)
        await self._link.send(plan)

    async def recv(self) -> executor_pb2.StepOutput:
        output = await self._link.recv()
        if self.timeline is not None:
            self.timeline.received(output)
        return output


@dataclass
class Arm:
    name: str
    link: RecordingLink
    address: str  # the planner's, for the clients
    planner: object  # the PlannerServicer
    server: StartedServer  # the planner's
    runner: StepRunner | None = None  # an in-process arm's
    child: ExecutorChild | None = None  # a gRPC arm's executor
    client_trust: dict | None = None  # what its clients send: client_security
    executor_timeline: ExecutorTimeline | None = None  # an in-process arm's, with --timeline

    @property
    def engine(self):
        return self.planner.engines[0]

    async def runner_times(self) -> dict:
        if self.child is not None:
            return await self.child.times()
        assert self.runner is not None  # an arm has one or the other
        return asdict(self.runner.times)

    async def timeline_steps(self) -> list[dict]:
        """The steps both sides noted since the last call, joined (--timeline), else none."""
        if self.link.timeline is None:
            return []
        if self.child is not None:
            executor = await self.child.timeline()
        else:
            executor = self.executor_timeline.take() if self.executor_timeline else []
        return joined(self.link.timeline.take(), executor)


def make_certs(directory: str) -> dict[str, str]:
    """A CA and a certificate for 127.0.0.1 (tests/certs.py: the `cryptography` package) for the TLS arm."""
    from tests.certs import make_pki

    pki = make_pki(directory)
    return {"ca": pki.ca.cert, "cert": pki.server.cert, "key": pki.server.key}


def client_security(arm: str, certs: dict[str, str] | None) -> dict:
    """What the clients send to the arm's planner: an API key (auth arm), a CA to trust (TLS arm)."""
    return {
        "api_key": BENCH_KEY if arm == AUTH_ARM else None,
        "ca": certs["ca"] if arm == TLS_ARM and certs else None,
    }


async def start_arm(
    name: str,
    planner_config: PlannerConfig,
    runner: StepRunner | None,
    child: ExecutorChild | None,
    certs: dict[str, str] | None = None,
) -> Arm:
    """The arm's planner, linked to its runner in this process or to its child's executor over gRPC."""
    tls = name == TLS_ARM and certs is not None
    link_security = ChannelSecurity(tls=ClientTLS(ca=certs["ca"]) if tls and certs else None)
    if child is None:
        # an arm without a child executor has its runner in this process (decode_run passes its runners)
        assert runner is not None
        link = RecordingLink(InProcessLink(runner))
    else:
        link = RecordingLink(GrpcLink(f"127.0.0.1:{child.port}", link_security))
    security = ServerSecurity(
        tls=ServerTLS(certs["cert"], certs["key"]) if tls and certs else None,
        keys=parse_keys(f"{BENCH_KEY} bench\n") if name == AUTH_ARM else None,
    )
    planner = await start_planner_server(planner_config, port=0, links=[link], security=security)
    address = f"127.0.0.1:{planner.port}"
    return Arm(name, link, address, planner.servicer, planner, runner, child, client_security(name, certs))
