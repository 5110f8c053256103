"""bench/decode.py's child processes, from the parent's side: LineChild (start, ask, close over JSON lines),
the executor's (ExecutorChild) and the load generator's (ClientsChild). What runs inside them is
bench/decode_serve.py."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import sys
from typing import Self

import numpy as np

from bench.decode_serve import RequestResult

READY_TIMEOUT_S = 900.0  # a child's start: an executor's model build and graph captures
TIMES_TIMEOUT_S = 30.0
MEASURE_TIMEOUT_S = 1800.0
CLOSE_TIMEOUT_S = 10.0
STDERR_TAIL_LINES = 40
# The script a child runs: the benchmark's entry point, in a hidden mode (--serve-executor, --serve-clients).
DECODE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode.py")


class LineChild:
    """bench/decode.py in a process of its own, in a hidden mode, talking JSON lines: requests on its stdin,
    answers on its stdout (which carries nothing else). It stops when its stdin closes."""

    def __init__(self, name: str, process: asyncio.subprocess.Process) -> None:
        self.name = name
        self.process = process
        # the pipes start() opens
        assert process.stdin and process.stdout and process.stderr
        self.stdin, self.stdout, self.stderr = process.stdin, process.stdout, process.stderr
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._stderr = asyncio.create_task(self._drain_stderr())

    @classmethod
    async def start(cls, name: str, *mode: str) -> Self:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        pythonpath = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
        env = dict(os.environ, PYTHONPATH=pythonpath)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            DECODE_SCRIPT,
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
        async for line in self.stderr:
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
            line = await asyncio.wait_for(self.stdout.readline(), timeout)
        except TimeoutError:
            self.process.kill()
            return {"error": await self._died(f"not ready after {timeout:.0f} s, killed")}
        if not line:
            return {"error": await self._died("exited before it was ready")}
        return json.loads(line)

    async def ask(self, request: dict, timeout: float) -> dict:
        """One request line, one answer line."""
        try:
            self.stdin.write(json.dumps(request).encode() + b"\n")
            await self.stdin.drain()
        except ConnectionError:  # the pipe broke: it died
            raise RuntimeError(await self._died("exited")) from None
        line = await asyncio.wait_for(self.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(await self._died("exited"))
        return json.loads(line)

    async def close(self) -> None:
        """Closes its stdin (it stops and exits); terminates it, then kills it, if it lingers."""
        if self.process.returncode is None:
            self.stdin.close()
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
