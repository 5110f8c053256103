"""GPU decode benchmark (issue 3): resident vs host-planned over gRPC, and resident through an in-process link.

    python bench/decode.py [--tokenizer DIR] [--concurrency 1,16,64,256] [--rounds 2]
                           [--out docs/bench/decode.json] [--plot docs/decode.png]
    python bench/decode.py --compile-only   # build FlashInfer's decode kernel (JIT) and exit
    python bench/decode.py --model-shape qwen3.5-0.8b --out docs/bench/decode_qwen3_5.json \
                           --plot docs/decode_qwen3_5.png   # the Qwen3.5 hybrid's shape

SmolLM2-135M's shape (or --model-shape's) with random bf16 weights (no checkpoint needed), random 512-token
prompts (ids below SmolLM2's vocabulary, which the default tokenizer decodes), 256 output
tokens each (EOS ignored), prefix cache off. Arms alternate within each round. Prints one line per
measurement; writes one JSON object per arm and concurrency (both rounds inside) and a plot of tok/s.

Processes as deployed: the gRPC arms run their executor in a child process of its own (this script with
--serve-executor), and the clients (the load generator) run in another child process (--serve-clients); the
planners and the in-process arm's executor share this process. Each record's "executor_process" ("child" or
"same") says where its executor ran, and its "clients_process" ("child") where its clients did.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Self, TextIO

import grpc
import numpy as np
import structlog
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deltaserve.aio
from bench.common import commit_hash, qwen3_5_0_8b_config, smollm2_config, write_json
from bench.in_process import InProcessLink
from bench.step_timeline import ExecutorTimeline, PlannerTimeline, in_ms, joined, summary
from executor_svc.config import DEFAULT_BUCKETS, DEFAULT_PREFILL_BUCKETS, ExecutorConfig
from executor_svc.models.dense import DenseModel
from executor_svc.models.family import ExecutorModel
from executor_svc.models.qwen3_5_model import Qwen35Model
from executor_svc.runner import StepRunner, runner_for_model
from executor_svc.server import start_executor_server
from planner_svc.config import PlannerConfig, SchedulingConfig
from planner_svc.link import GrpcLink
from planner_svc.server import start_planner_server
from protos import client_pb2, client_pb2_grpc, executor_pb2
from protos.auth import parse_keys
from protos.heap import freeze_startup_heap
from protos.rpc import ChannelSecurity, ServerSecurity, StartedServer, open_channel
from protos.tls import ClientTLS, ServerTLS
from protos.wire import pack_i32, unpack_i32

ARMS = ("resident", "host-planned", "resident-inprocess", "resident-auth", "resident-tls")
DEFAULT_ARMS = ARMS[:3]
# The resident gRPC arm with the planner's client API behind an API key (the interceptor's cost), or with TLS
# on the client API and on the planner's link to the executor (TLS's cost).
AUTH_ARM, TLS_ARM = "resident-auth", "resident-tls"
BENCH_KEY = "bench-key-0123456789abcdef"
PAGE_SIZE = 16
MAX_SEQ_LEN = 1024
READY_TIMEOUT_S = 900.0  # a child's start: an executor's model build and graph captures
TIMES_TIMEOUT_S = 30.0
MEASURE_TIMEOUT_S = 1800.0
CLOSE_TIMEOUT_S = 10.0
STDERR_TAIL_LINES = 40
SMOLLM2 = smollm2_config()
MODEL_SHAPES = ("smollm2-135m", "qwen3.5-0.8b")


def random_model(device: torch.device, shape: str = MODEL_SHAPES[0]) -> ExecutorModel:
    """The shape's model, weights ~ N(0, 0.02) and norms of one (Qwen3.5's (1 + w) norms: w = 0), gated delta
    net decays as transformers initialises them, in bf16."""
    if shape == "qwen3.5-0.8b":
        model: ExecutorModel = Qwen35Model(qwen3_5_0_8b_config(), device=device, dtype=torch.bfloat16)
    else:
        model = DenseModel(SMOLLM2, device=device, dtype=torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(0)
    offset_norms = isinstance(model, Qwen35Model)
    with torch.no_grad():
        for name, param in model.named_parameters():  # type: ignore[attr-defined]
            if name.endswith("linear_attn.norm.weight"):
                param.fill_(1.0)
            elif name.endswith("norm.weight"):
                param.fill_(0.0 if offset_norms else 1.0)
            elif name.endswith("A_log"):
                param.copy_(
                    torch.empty_like(param, dtype=torch.float32).uniform_(1, 16, generator=generator).log()
                )
            elif name.endswith("dt_bias"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model


def model_fingerprint(shape: str) -> str:
    return f"random-{shape}"


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


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


def executor_config(
    device: str,
    pool_pages: int,
    buckets: tuple[int, ...],
    arm: str,
    prefill_buckets: tuple[int, ...],
) -> ExecutorConfig:
    return ExecutorConfig(
        device=device,
        prefill_buckets=prefill_buckets,
        dtype="bfloat16",
        page_size=PAGE_SIZE,
        pool_pages=pool_pages,
        max_seq_len=MAX_SEQ_LEN,
        buckets=buckets,
        decode_path="host-planned" if arm == "host-planned" else "resident",
    )


def build_runner(
    model: ExecutorModel, config: ExecutorConfig, shape: str
) -> tuple[StepRunner | None, dict[str, str]]:
    """The runner and its capture state per bucket; (None, {"error": ...}) when it cannot be built."""
    try:
        runner = runner_for_model(model, config, model_fingerprint(shape))
    except Exception as err:  # an arm that cannot be built is reported; the rest run
        return None, {"error": f"{type(err).__name__}: {err}"}
    graphs = runner.graphs
    return runner, {str(b): s for b, s in graphs.states.items()} if graphs else {"all": "eager (CPU)"}


class LineChild:
    """This script in a process of its own, in a hidden mode, talking JSON lines: requests on its stdin, answers
    on its stdout (which carries nothing else). It stops when its stdin closes."""

    def __init__(self, name: str, process: asyncio.subprocess.Process) -> None:
        self.name = name
        self.process = process
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._stderr = asyncio.create_task(self._drain_stderr())

    @classmethod
    async def start(cls, name: str, *mode: str) -> Self:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        pythonpath = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
        env = dict(os.environ, PYTHONPATH=pythonpath)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            os.path.abspath(__file__),
            *mode,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            limit=1 << 26,  # the clients' answer to a measurement is one long line
        )
        return cls(name, process)

    async def _drain_stderr(self) -> None:
        # Read all along, so a chatty child never blocks on a full pipe; echoed, and the tail kept for errors.
        async for line in self.process.stderr:
            text = line.decode(errors="replace").rstrip()
            self.stderr_tail.append(text)
            print(f"[{self.name}] {text}", file=sys.stderr, flush=True)

    async def _died(self, what: str) -> str:
        await self.process.wait()
        await self._stderr  # the whole tail: the pipe closes when the process ends
        tail = "\n".join(self.stderr_tail)
        return f"{self.name} process {what} (exit code {self.process.returncode}); its stderr ends:\n{tail}"

    async def _first_line(self, timeout: float) -> dict:
        """Its first answer (ready, or not), or {"error": ...} when it died or timed out first."""
        try:
            line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        except TimeoutError:
            self.process.kill()
            return {"error": await self._died(f"not ready after {timeout:.0f} s, killed")}
        if not line:
            return {"error": await self._died("exited before it was ready")}
        return json.loads(line)

    async def ask(self, request: dict, timeout: float) -> dict:
        """One request line, one answer line."""
        try:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            await self.process.stdin.drain()
        except ConnectionError:  # the pipe broke: it died
            raise RuntimeError(await self._died("exited")) from None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(await self._died("exited"))
        return json.loads(line)

    async def close(self) -> None:
        """Closes its stdin (it stops and exits); terminates it, then kills it, if it lingers."""
        if self.process.returncode is None:
            self.process.stdin.close()
            for escalate in (self.process.terminate, self.process.kill):
                try:
                    await asyncio.wait_for(self.process.wait(), CLOSE_TIMEOUT_S)
                    break
                except TimeoutError:
                    escalate()
            await self.process.wait()
        await self._stderr


class ExecutorChild(LineChild):
    """An executor server (--serve-executor): its first line is {"port", "capture"} or {"error"}; then it
    answers each {"times": true} with its RunnerTimes."""

    port = 0

    async def ready(self) -> dict[str, str]:
        """Its capture states once it serves, or {"error": ...} when it could not build, died or timed out."""
        message = await self._first_line(READY_TIMEOUT_S)
        if "error" in message:
            return message
        self.port = message["port"]
        return message["capture"]

    async def times(self) -> dict:
        """Its RunnerTimes, as a dict."""
        return await self.ask({"times": True}, TIMES_TIMEOUT_S)

    async def timeline(self) -> list[dict]:
        """The steps its ExecutorTimeline noted since the last ask (--serve-timeline)."""
        return (await self.ask({"timeline": True}, TIMES_TIMEOUT_S))["steps"]


class ClientsChild(LineChild):
    """The load generator (--serve-clients), apart from the planners as real clients are: for each
    {"address", "prompts", "max_tokens"} it runs every request at once and answers their results and the
    wall time of the lot, by its own clock."""

    gc_ms = 0.0  # the last measurement's garbage collection pauses in the clients' process

    async def ready(self) -> None:
        message = await self._first_line(READY_TIMEOUT_S)
        if "error" in message:
            raise RuntimeError(message["error"])

    async def generate(
        self, address: str, prompts: list[np.ndarray], max_tokens: int, security: dict | None = None
    ) -> tuple[list[RequestResult], float]:
        """The requests' results and the wall time of them all, both by the clients' clock. `security`: the
        API key and the CA the clients use (client_security)."""
        request = {"address": address, "prompts": [p.tolist() for p in prompts], "max_tokens": max_tokens}
        answer = await self.ask({**request, "security": security or {}}, MEASURE_TIMEOUT_S)
        self.gc_ms = answer["gc_ms"]
        results = [
            RequestResult(r["sent"], [tuple(a) for a in r["arrivals"]], r["tokens"], r["error"])
            for r in answer["results"]
        ]
        return results, answer["wall"]


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
        return asdict(self.runner.times) if self.child is None else await self.child.times()

    async def timeline_steps(self) -> list[dict]:
        """The steps both sides noted since the last call, joined (--timeline), else none."""
        if self.link.timeline is None:
            return []
        if self.child is not None:
            executor = await self.child.timeline()
        else:
            executor = self.executor_timeline.take() if self.executor_timeline else []
        return joined(self.link.timeline.take(), executor)


@dataclass
class RequestResult:
    sent: float
    arrivals: list[tuple[float, int]]  # (time, tokens in that message)
    tokens: list[int]
    error: str | None


async def one_request(
    stub: client_pb2_grpc.PlannerStub, prompt: np.ndarray, max_tokens: int
) -> RequestResult:
    request = client_pb2.GenerateRequest(token_ids=pack_i32(prompt), max_tokens=max_tokens, ignore_eos=True)
    sent = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    tokens: list[int] = []
    try:
        async for response in stub.Generate(request):
            ids = unpack_i32(response.token_ids)
            if len(ids):
                arrivals.append((time.perf_counter(), len(ids)))
                tokens.extend(int(t) for t in ids)
    except grpc.aio.AioRpcError as err:
        return RequestResult(sent, arrivals, tokens, f"{err.code().name}: {err.details()}")
    return RequestResult(sent, arrivals, tokens, None)


def per_step(total: float, steps: int) -> float:
    return round(total / steps, 2) if steps else 0.0


async def measure(
    arm: Arm, clients: ClientsChild, prompts: list[np.ndarray], max_tokens: int
) -> tuple[dict, list[list[int]]]:
    engine_before, runner_before = asdict(arm.engine.times), await arm.runner_times()
    await arm.timeline_steps()  # what came before the round (the warm-up's steps) is no part of it
    arm.link.steady_bytes.clear()
    arm.link.slot_change_bytes.clear()
    # The wall time of the requests' gather in the clients' process, not this round trip: the lines' transfer
    # (a few MB at c=256) is no part of the service.
    results, wall = await clients.generate(arm.address, prompts, max_tokens, arm.client_trust)
    engine = {k: v - engine_before[k] for k, v in asdict(arm.engine.times).items()}
    runner = {k: v - runner_before[k] for k, v in (await arm.runner_times()).items()}
    ttft = [r.arrivals[0][0] - r.sent for r in results if r.arrivals]
    itl: list[float] = []
    for r in results:  # a message of n tokens after a gap stands for n gaps of gap / n
        for (before, _), (after, n) in zip(r.arrivals, r.arrivals[1:]):
            itl += [(after - before) / n] * n
    tokens = sum(len(r.tokens) for r in results)
    failed = sum(1 for r in results if r.error or len(r.tokens) != max_tokens)
    steps, decode_steps = engine["steps"], runner["steps"]
    step_us = wall * 1e6 / steps if steps else 0.0
    graph_us = per_step(runner["graph_us"], decode_steps)
    steady, slot_change = arm.link.steady_bytes, arm.link.slot_change_bytes
    figures = {
        "tok_s": round(tokens / wall, 1),
        "clients_gc_ms": clients.gc_ms,  # inside the wall: the load generator's own pauses
        "itl_p50_ms": round(statistics.median(itl) * 1e3, 3) if itl else None,
        "itl_mean_ms": round(statistics.fmean(itl) * 1e3, 3) if itl else None,
        "ttft_p50_ms": round(statistics.median(ttft) * 1e3, 2) if ttft else None,
        "failed": failed,
        "errors": sorted({r.error for r in results if r.error})[:3],
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "steps": steps,
        "step_us": round(step_us, 1),
        # Host microseconds per step: the planner's phases (per step it ran) and the executor's (per decode step).
        "planner_us": {
            k: per_step(engine[f"{k}_us"], steps)
            for k in ("plan", "encode", "send", "wait", "stream", "commit")
        },
        # Client streams the planner wrote to per step (the rest of the running requests' tokens waited).
        "streams_written_per_step": per_step(engine["streams_written"], steps),
        "executor_us": {
            k: per_step(runner[f"{k}_us"], decode_steps)
            for k in ("apply", "plan", "prefill", "launch", "sync")
        },
        "graph_us": graph_us,
        # The GPU's share of a steady decode step (no prefill in it), from CUDA events: graph time over the
        # time between consecutive replays' ends.
        "gpu_busy_steady": (
            round(runner["steady_graph_us"] / runner["steady_period_us"], 3)
            if runner["steady_period_us"]
            else None
        ),
        "steady_period_us": per_step(runner["steady_period_us"], runner["steady_steps"]),
        # Wall time of a step the decode graph did not cover: prefill on the GPU, and the GPU idle.
        "outside_graph_us": round(step_us - graph_us, 1) if decode_steps else None,
        "plan_bytes_mean": round(engine["plan_bytes"] / steps, 1) if steps else None,
        "steady_plan_bytes_median": int(statistics.median(steady)) if steady else None,
        "steady_plan_bytes_max": max(steady) if steady else None,
        "slot_change_plan_bytes_median": int(statistics.median(slot_change)) if slot_change else None,
    }
    steps = await arm.timeline_steps()
    if steps:  # the summary stays in the round's figures; the steps go to the --timeline file
        arrived = [r.arrivals[-1][0] for r in results if r.arrivals]
        requests = (min(r.sent for r in results), max(arrived)) if arrived else None
        figures["timeline"] = summary(steps, requests)
        figures["timeline_steps"] = steps
    return figures, [r.tokens for r in results]


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
    link = RecordingLink(
        InProcessLink(runner) if child is None else GrpcLink(f"127.0.0.1:{child.port}", link_security)
    )
    security = ServerSecurity(
        tls=ServerTLS(certs["cert"], certs["key"]) if tls and certs else None,
        keys=parse_keys(f"{BENCH_KEY} bench\n") if name == AUTH_ARM else None,
    )
    planner = await start_planner_server(planner_config, port=0, links=[link], security=security)
    address = f"127.0.0.1:{planner.port}"
    return Arm(name, link, address, planner.servicer, planner, runner, child, client_security(name, certs))


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Requests whose whole outputs are equal, and the mean length of the common prefix."""
    same = sum(1 for x, y in zip(a, b) if x == y)
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return {"equal": same, "of": len(a), "mean_common_prefix": round(statistics.fmean(prefixes), 1)}


def compile_only(shape: str) -> None:
    """Build FlashInfer's decode kernel for the shape (its JIT cache then serves the benchmark)."""
    from executor_svc.attention.host_planned import FlashInferDecode, plan_from_rows
    from executor_svc.kv_pool import KVPool
    from protos.layout import RowLayout

    began = time.perf_counter()
    device = torch.device("cuda")
    cfg = qwen3_5_0_8b_config() if shape == "qwen3.5-0.8b" else SMOLLM2
    kv = KVPool(1, 4, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, device)
    layout = RowLayout(slots=3, block_span=4)
    attention = FlashInferDecode((1,), kv, cfg.num_heads, layout.block_span, cfg.head_dim**-0.5)
    rows = np.zeros((layout.slots, layout.columns), dtype=np.int32)
    attention.plan(1, plan_from_rows(rows, np.zeros(1, dtype=np.int32), PAGE_SIZE, 4 * PAGE_SIZE))
    q = torch.zeros(1, cfg.num_heads, cfg.head_dim, dtype=torch.bfloat16, device=device)
    attention.attend(1, 0, q)
    torch.cuda.synchronize()
    print(f"FlashInfer decode kernel ready in {time.perf_counter() - began:.1f} s", flush=True)


def protocol_stdout() -> TextIO:
    """A LineChild's protocol: the real stdout, for its lines only; fd 1 then points at stderr, so anything
    else printed (logs included) goes there."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return protocol


async def answer_lines(protocol: TextIO, answer: Callable[[dict], dict], stop: asyncio.Event) -> None:
    """A LineChild's side of `ask`: one answer line per request line on stdin, until stdin closes or a stop
    signal. `answer` runs in a thread of its own (stdin is read blocking); the event loop stays free."""
    loop = asyncio.get_running_loop()
    stdin_closed = asyncio.Event()

    def serve() -> None:
        try:
            for line in sys.stdin:
                protocol.write(json.dumps(answer(json.loads(line))) + "\n")
        finally:  # also when an answer raised: its traceback is on stderr, and the process exits
            # (the parent's `ask` then fails with that stderr's tail, rather than waiting for its timeout)
            loop.call_soon_threadsafe(stdin_closed.set)

    threading.Thread(target=serve, daemon=True).start()
    await deltaserve.aio.until_stopped(stdin_closed.wait(), stop)


async def serve_executor(args: argparse.Namespace, stop: asyncio.Event) -> None:
    """The child's side of ExecutorChild: builds the arm's runner, serves it, answers `times` until stdin
    closes."""
    protocol = protocol_stdout()
    buckets = int_list(args.buckets)
    config = executor_config(
        args.device, args.pool_pages, buckets, args.serve_executor, int_list(args.prefill_buckets)
    )
    runner, states = build_runner(
        random_model(torch.device(args.device), args.model_shape), config, args.model_shape
    )
    if runner is None:
        protocol.write(json.dumps(states) + "\n")
        return
    tls = ServerTLS(args.tls_cert, args.tls_key) if args.tls_cert else None
    server = await start_executor_server(runner, security=ServerSecurity(tls=tls))
    protocol.write(json.dumps({"port": server.port, "capture": states}) + "\n")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    freeze_startup_heap()  # as `deltaserve executor` does once serving
    timeline = ExecutorTimeline(runner) if args.serve_timeline else None

    def answer(request: dict) -> dict:
        """{"times": true} or {"timeline": true}: the runner's floats and notes are safe to read from
        answer_lines' thread."""
        if request.get("timeline"):
            return {"steps": timeline.take() if timeline else []}
        return asdict(runner.times)

    await answer_lines(protocol, answer, stop)
    await server.stop(None)


async def serve_clients(stop: asyncio.Event) -> None:
    """The child's side of ClientsChild: runs each measurement's requests at once, against the planner named
    (one channel per planner, kept for the run)."""
    protocol = protocol_stdout()
    loop = asyncio.get_running_loop()
    stubs: dict[str, client_pb2_grpc.PlannerStub] = {}
    channels: list[grpc.aio.Channel] = []

    async def generate(request: dict) -> dict:
        address, trust = request["address"], request.get("security") or {}
        if address not in stubs:
            tls = ClientTLS(ca=trust["ca"]) if trust.get("ca") else None
            channels.append(open_channel(address, ChannelSecurity(tls=tls, api_key=trust.get("api_key"))))
            stubs[address] = client_pb2_grpc.PlannerStub(channels[-1])
        prompts = [np.asarray(p, dtype=np.int32) for p in request["prompts"]]
        paused.clear()
        began = time.perf_counter()
        results = await asyncio.gather(
            *(one_request(stubs[address], p, request["max_tokens"]) for p in prompts)
        )
        wall = time.perf_counter() - began  # this process's clock, as the arrivals'
        return {"results": [asdict(r) for r in results], "wall": wall, "gc_ms": round(sum(paused) * 1e3, 2)}

    # The collector's pauses in this process during a measurement: they stretch its wall, not the service's.
    paused: list[float] = []
    started = [0.0]

    def note_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            paused.append(time.perf_counter() - started[0])

    gc.callbacks.append(note_collection)
    freeze_startup_heap()  # as the services' processes do
    protocol.write(json.dumps({"ready": True}) + "\n")
    # The requests run on the event loop; answer_lines' thread waits for each measurement's lot.
    await answer_lines(
        protocol, lambda request: asyncio.run_coroutine_threadsafe(generate(request), loop).result(), stop
    )
    for channel in channels:
        await channel.close()


async def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    widest = max(concurrencies)
    pages_per_request = -(-(args.prompt_tokens + args.output_tokens + 1) // PAGE_SIZE)
    pool_pages = widest * pages_per_request + 64
    buckets = tuple(b for b in DEFAULT_BUCKETS if b < widest) + (widest,)
    scheduling = SchedulingConfig(prefix_cache=False, prefill_token_budget=args.prefill_token_budget)
    planner_config = PlannerConfig(model=args.tokenizer, scheduling=scheduling)
    runners: dict[str, StepRunner] = {}
    children: dict[str, ExecutorChild] = {}
    capture: dict[str, dict] = {}
    arms: dict[str, Arm] = {}
    clients: ClientsChild | None = None
    timeline: list[dict] = []  # --timeline: each round's steps
    certs = make_certs(tempfile.mkdtemp(prefix="bench-tls-")) if TLS_ARM in args.arms else None
    try:
        # The clients' process first, before this one has a gRPC thread: a fork (the subprocess's spawn) while
        # gRPC's threads run skips its fork handlers, and the child died of SIGSEGV before it was ready.
        clients = await ClientsChild.start("clients", "--serve-clients")
        # The executors' children, one at a time, then this process's runner: each capture has the GPU to
        # itself (and a capture must be the only CUDA work in its process).
        for name in sorted(args.arms, key=in_process):
            began = time.perf_counter()
            if in_process(name):
                config = executor_config(
                    args.device, pool_pages, buckets, name, int_list(args.prefill_buckets)
                )
                runner, states = build_runner(
                    random_model(device, args.model_shape), config, args.model_shape
                )
            else:
                child = children[name] = await ExecutorChild.start(
                    f"{name} executor",
                    "--serve-executor",
                    name,
                    "--device",
                    args.device,
                    "--pool-pages",
                    str(pool_pages),
                    "--buckets",
                    ",".join(map(str, buckets)),
                    "--model-shape",
                    args.model_shape,
                    "--prefill-buckets",
                    args.prefill_buckets,
                    *(["--serve-timeline"] if args.timeline else []),
                    *(
                        ["--tls-cert", certs["cert"], "--tls-key", certs["key"]]
                        if name == TLS_ARM and certs
                        else []
                    ),
                )
                runner, states = None, await child.ready()
            if "error" in states:
                print(f"{name}: not built: {states['error']}", flush=True)
            else:
                print(f"{name}: built in {time.perf_counter() - began:.1f} s; buckets {states}", flush=True)
                if all(state.startswith("eager (capture failed") for state in states.values()):
                    states = {"error": f"no bucket could be captured: {states[str(buckets[0])]}"}
            capture[name] = states
            if "error" in states:
                if name in children:
                    await children.pop(name).close()
            elif runner is not None:
                runners[name] = runner
        # Planners start once every capture is done.
        for name in args.arms:
            if name in runners or name in children:
                arm = arms[name] = await start_arm(
                    name, planner_config, runners.get(name), children.get(name), certs
                )
                if args.timeline:
                    arm.link.timeline = PlannerTimeline()
                    if arm.runner is not None:
                        arm.executor_timeline = ExecutorTimeline(arm.runner)
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
        freeze_startup_heap()  # as `deltaserve planner` does once serving
        await clients.ready()

        rng = np.random.default_rng(0)
        # Prompts of the measured length at every measured concurrency: the kernels compile, and every bucket's
        # graph makes its first replay, for the shapes the rounds will run.
        for c in concurrencies:
            warm = [
                rng.integers(3, SMOLLM2.vocab_size, size=args.prompt_tokens).astype(np.int32)
                for _ in range(c)
            ]
            for arm in arms.values():
                await measure(arm, clients, warm, 8)
        results: dict[tuple[str, int], list[dict]] = {}
        outputs: dict[tuple[str, int, int], list[list[int]]] = {}
        for round_index in range(args.rounds):
            for c in concurrencies:
                # The same prompts for every arm and round, so their outputs can be compared.
                prompts = [
                    np.random.default_rng(1000 + c * 7 + i)
                    .integers(3, SMOLLM2.vocab_size, size=args.prompt_tokens)
                    .astype(np.int32)
                    for i in range(c)
                ]
                for name, arm in arms.items():
                    figures, tokens = await measure(arm, clients, prompts, args.output_tokens)
                    steps = figures.pop("timeline_steps", None)
                    if steps:
                        timeline.append(
                            {"arm": name, "concurrency": c, "round": round_index + 1, "steps": in_ms(steps)}
                        )
                    results.setdefault((name, c), []).append(figures)
                    outputs[(name, c, round_index)] = tokens
                    print(
                        f"round {round_index + 1} {name:19s} c={c:4d}  {figures['tok_s']:9.1f} tok/s  "
                        f"ITL p50 {figures['itl_p50_ms']} ms mean {figures['itl_mean_ms']} ms  "
                        f"TTFT p50 {figures['ttft_p50_ms']} ms  failed {figures['failed']}  "
                        f"step {figures['step_us']} us (graph {figures['graph_us']}, steady period "
                        f"{figures['steady_period_us']}, busy {figures['gpu_busy_steady']})  "
                        f"streams/step {figures['streams_written_per_step']}  "
                        f"planner {figures['planner_us']}  executor {figures['executor_us']}  "
                        f"steady plan {figures['steady_plan_bytes_median']} B",
                        flush=True,
                    )
                    if "timeline" in figures:
                        print(f"  timeline {figures['timeline']}", flush=True)
    finally:
        if clients is not None:
            await clients.close()
        for arm in arms.values():
            await arm.server.stop(None)
        for child in children.values():
            await child.close()

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU smoke run)"
    records = []
    for (name, c), rounds in results.items():
        record = {
            "arm": name,
            "executor_process": executor_process(name),
            "clients_process": "child",
            "concurrency": c,
            "tok_s": round(statistics.fmean(r["tok_s"] for r in rounds), 1),
            "itl_p50_ms": round(statistics.fmean(r["itl_p50_ms"] or 0.0 for r in rounds), 3),
            "itl_mean_ms": round(statistics.fmean(r["itl_mean_ms"] or 0.0 for r in rounds), 3),
            "ttft_p50_ms": round(statistics.fmean(r["ttft_p50_ms"] or 0.0 for r in rounds), 2),
            "failed": sum(r["failed"] for r in rounds),
            "model_shape": args.model_shape,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "prefill_token_budget": scheduling.for_device(args.device).token_budget,
            "prefill_buckets": args.prefill_buckets,
            "rounds": rounds,
            "capture": capture[name],
            "commit": args.commit or commit_hash(),
            "gpu": gpu,
        }
        # bf16: against the resident arm's first round, and against its own other round (its own spread).
        if ("resident", c, 0) in outputs and name != "resident":
            record["agreement_with_resident"] = agreement(outputs[("resident", c, 0)], outputs[(name, c, 0)])
        if args.rounds > 1:
            record["agreement_across_rounds"] = agreement(outputs[(name, c, 0)], outputs[(name, c, 1)])
        records.append(record)
    for name, state in capture.items():
        if "error" in state:
            records.append(
                {
                    "arm": name,
                    "executor_process": executor_process(name),
                    "clients_process": "child",
                    "error": state["error"],
                    "commit": args.commit or commit_hash(),
                    "gpu": gpu,
                }
            )
    if args.timeline:
        write_json(args.timeline, timeline)
    return records


def plot(records: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    figure, axes = plt.subplots(figsize=(6, 4))
    for arm in ARMS:
        points = sorted(
            (r["concurrency"], r["tok_s"]) for r in records if r.get("arm") == arm and "tok_s" in r
        )
        if points:
            axes.plot(*zip(*points), marker="o", label=arm)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("concurrent requests")
    axes.set_ylabel("output tokens / s")
    gpu = next((r["gpu"] for r in records if "gpu" in r), "")
    shape = next((r["model_shape"] for r in records if "model_shape" in r), MODEL_SHAPES[0])
    axes.set_title(f"{shape} shape, bf16, 512 in / 256 out ({gpu})", fontsize=9)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir or GGUF (default: the SmolLM2 GGUF)")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument(
        "--model-shape",
        choices=MODEL_SHAPES,
        default=MODEL_SHAPES[0],
        help="the model whose shape random bf16 weights fill (qwen3.5-0.8b: the hybrid, its state pool by slot)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--arms",
        type=arm_list,
        default=DEFAULT_ARMS,
        help=f"comma-separated, of {','.join(ARMS)} (default: {','.join(DEFAULT_ARMS)}); resident-auth and "
        "resident-tls are the resident gRPC arm with an API key, or TLS, on the client API (and TLS on the "
        "planner's link to the executor): their cost against resident",
    )
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument(
        "--prefill-token-budget", type=int, default=None, help="prompt tokens a step (default: the planner's)"
    )
    parser.add_argument(
        "--prefill-buckets",
        default=",".join(map(str, DEFAULT_PREFILL_BUCKETS)),
        help="prefill graphs' token buckets (default: the executor's)",
    )
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--out", default="docs/bench/decode.json")
    parser.add_argument("--plot", default="docs/decode.png")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    parser.add_argument(
        "--timeline",
        help="write each round's steps (bench/step_timeline.py) to this JSON file, and a summary per round",
    )
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the harness (eager, no graphs)")
    # The executor child's mode (ExecutorChild starts it): the arm, its pool and its buckets.
    child_arms = [arm for arm in ARMS if not in_process(arm)]
    parser.add_argument("--serve-executor", choices=child_arms, help=argparse.SUPPRESS)
    parser.add_argument("--pool-pages", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--buckets", help=argparse.SUPPRESS)
    parser.add_argument("--tls-cert", help=argparse.SUPPRESS)  # the TLS arm's executor child
    parser.add_argument("--tls-key", help=argparse.SUPPRESS)
    parser.add_argument("--serve-clients", action="store_true", help=argparse.SUPPRESS)  # ClientsChild's mode
    parser.add_argument(
        "--serve-timeline", action="store_true", help=argparse.SUPPRESS
    )  # its executor's notes
    args = parser.parse_args()
    if args.serve_clients:  # the load generator needs no device
        deltaserve.aio.run(serve_clients)
        return
    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit("bench/decode.py needs a CUDA device (or --device cpu for a smoke run)")
    if args.compile_only:
        compile_only(args.model_shape)
        return
    if args.serve_executor:
        deltaserve.aio.run(lambda stop: serve_executor(args, stop))
        return
    records = deltaserve.aio.run(lambda stop: run(args))
    write_json(args.out, records)
    plot(records, args.plot)


if __name__ == "__main__":
    main()
