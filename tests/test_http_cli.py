"""The HTTP API from the command line: `deltaserve up --http-port` beside gRPC, and `deltaserve http` as its
own process over that planner; the bearer key of each HTTP caller checked by the planner's --api-keys; `up`'s
one --metrics-port for every service in it (planner, executor, cache, gateway), parsed with
prometheus-client's parser."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx2 as httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from planner_svc.client import PlannerClient
from protos.rpc import ChannelSecurity
from tests.cli_helpers import Serving, free_port

ALICE = "alice-http-key-0123456789"
QUESTION = [{"role": "user", "content": "Name a colour."}]


def test_up_serves_http_beside_grpc_and_http_runs_alone_with_the_same_keys(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{ALICE} alice\n")
    port, http_port, alone_port, metrics_port, cache_port = (free_port() for _ in range(5))
    up = Serving(
        tmp_path / "up.log",
        "up",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--http-workers",
        "2",  # two child processes on the one port, both counted in up's metrics
        "--api-keys",
        str(keys),
        "--metrics-port",
        str(metrics_port),
        "--cache-port",
        str(cache_port),
        "--cache-dir",
        str(tmp_path / "snapshots"),
        "--device",
        "cpu",
        "--pool-pages",
        "64",
        "--buckets",
        "1,2",
        "--max-seq-len",
        "512",
    )
    alone = None
    try:
        listening = up.wait_listening(180)
        assert (listening["addr"], listening["http"]) == (f"127.0.0.1:{port}", f"127.0.0.1:{http_port}")
        alone = Serving(
            tmp_path / "http.log",
            "http",
            "--planner",
            f"127.0.0.1:{port}",
            "--port",
            str(alone_port),
            "--workers",
            "2",
        )
        assert alone.wait_listening(60)["addr"] == f"127.0.0.1:{alone_port}"
        a_second_group_of_workers_on_the_port_is_refused(http_port, port)
        answers = []
        for served in (http_port, alone_port):
            base = f"http://127.0.0.1:{served}"
            assert httpx.get(f"{base}/health").status_code == 200
            missing = httpx.post(f"{base}/v1/chat/completions", json={"model": "m", "messages": QUESTION})
            assert missing.status_code == 401 and "no API key" in missing.json()["error"]["message"]
            with pytest.raises(openai.AuthenticationError, match="unknown API key"):
                openai.OpenAI(
                    api_key="wrong-key-0123456789", base_url=f"{base}/v1", max_retries=0
                ).models.list()
            client = openai.OpenAI(api_key=ALICE, base_url=f"{base}/v1", max_retries=0)
            model = client.models.list().data[0].id
            reply = client.chat.completions.create(
                model=model, messages=QUESTION, max_tokens=4, temperature=0
            )
            answers.append(reply.choices[0].message.content)
        assert answers[0] == answers[1] and answers[0]
        asyncio.run(executor_takes_only_the_service_key(listening["executor"]))
        check_metrics(f"http://127.0.0.1:{http_port}/v1", f"127.0.0.1:{port}", metrics_port)
        a_worker_killed_is_started_again(up, http_port)
    finally:
        codes = [alone.stop() if alone is not None else 0, up.stop()]
    assert codes == [0, 0], (up.log_path.read_text()[-2000:], alone and alone.log_path.read_text()[-2000:])


def test_a_sigterm_to_ups_whole_group_lets_an_http_stream_finish_in_the_drain(tmp_path):
    """systemd's stop (and `kill -- -PGID`) signals every process of the group, the HTTP child too: it waits for
    the parent's drain, which lets the stream run to its end, where it used to stop at once and cut the stream
    after its 5 s grace (no [DONE], the request aborted)."""
    port, http_port = free_port(), free_port()
    up = Serving(
        tmp_path / "up.log",
        *("up", "--port", str(port), "--http-port", str(http_port), "--no-cache", "--device", "cpu"),
        *("--pool-pages", "160", "--buckets", "1,2", "--max-seq-len", "2048", "--drain-timeout", "120"),
        own_group=True,
    )
    try:
        up.wait_listening(180)
        base = f"http://127.0.0.1:{http_port}/v1"
        model = httpx.get(f"{base}/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{base}/completions", json=body | {"stream": True}, timeout=180) as stream:
            for line in filter(None, stream.iter_lines()):
                events.append(line)
                if len(events) == 20:  # streaming: now the group's SIGTERM
                    signalled = time.monotonic()
                    os.killpg(up.process.pid, signal.SIGTERM)
        lasted = time.monotonic() - signalled
        data = [json.loads(line[6:]) for line in events if line.startswith("data: {")]
        assert events[-1] == "data: [DONE]", (lasted, events[-3:])
        assert data[-1]["choices"][0]["finish_reason"] == "length", data[-1]
        assert up.process.wait(timeout=150) == 0
        drained = [e for e in up.events() if e["event"] == "drained"]
        assert drained and drained[0]["finished"] == 1 and drained[0]["cut"] == 0, drained
        # the child read the parent's word to stop: its pipe closed cleanly, no reset read as an error
        assert not [e for e in up.events() if e["level"] in ("error", "critical")], up.events()[-5:]
    finally:
        if up.process.poll() is None:
            os.killpg(up.process.pid, signal.SIGKILL)
            up.process.wait()


def test_the_http_port_binds_again_while_closed_connections_wait_out_time_wait():
    """A drain closes the gateway's connections from its side, which leaves them in TIME-WAIT on the port for a
    minute: a restart found the port "taken" after loading the whole model. Another listener is still refused."""
    import socket

    from gateway_svc.http_server import _listen, check_free

    listener = _listen("127.0.0.1", 0, reuse_port=False)
    port = listener.getsockname()[1]
    listener.setblocking(True)
    with socket.create_connection(("127.0.0.1", port)) as client:
        accepted, _ = listener.accept()
        accepted.close()  # the server's side closes first: its end waits in TIME-WAIT
        client.recv(1)
    listener.close()
    again = _listen("127.0.0.1", port, reuse_port=False)
    try:
        with pytest.raises(OSError, match=f"port {port} is taken"):
            check_free("127.0.0.1", port)
    finally:
        again.close()


def test_a_worker_process_logs_under_the_command_that_started_it(capfd):
    """The children of `http --workers N` said "service": "up" on every line, as if `up` had started them; and
    --reasoning-field reaches them."""
    import contextlib
    from types import SimpleNamespace

    from deltaserve.http_launch import start_http_api

    async def start_and_stop(command: str) -> None:
        args = SimpleNamespace(
            command=command,
            host="127.0.0.1",
            trust=SimpleNamespace(server=SimpleNamespace(tls=None)),
            log_level="info",
            log_json=True,
            reasoning_field="reasoning_content" if command == "up" else "none",
        )
        async with contextlib.AsyncExitStack() as servers:  # no planner there: the API answers 503 meanwhile
            await start_http_api(servers, "127.0.0.1:1", args, 0, ChannelSecurity(), None, processes=1)

    for command in ("http", "up"):
        asyncio.run(start_and_stop(command))
        lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
        listening = [line for line in lines if line["event"] == "HTTP API listening"]
        assert [line["service"] for line in listening] == [command], lines
        field = "reasoning_content" if command == "up" else None
        assert [line["reasoning_field"] for line in listening] == [field]  # the flag reached it


def scrape(metrics_port: int) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def check_metrics(base: str, planner: str, metrics_port: int) -> None:
    """A conversation's turn, parked and resumed by its next turn: every service's metrics move."""
    before = scrape(metrics_port)
    client = openai.OpenAI(api_key=ALICE, base_url=base, max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("any/other-model")
    chat = [*QUESTION]
    first = client.chat.completions.create(
        model=model, messages=chat, max_tokens=3, temperature=0, extra_body={"conversation_id": "m"}
    )

    async def park() -> None:
        async with PlannerClient(planner, ChannelSecurity(api_key=ALICE)) as planner_client:
            await planner_client.park("m")

    asyncio.run(park())
    chat += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "More."},
    ]
    second = client.chat.completions.create(
        model=model, messages=chat, max_tokens=3, temperature=0, extra_body={"conversation_id": "m"}
    )
    assert second.model_extra["deltaserve"]["checkpoint"].startswith("snapshot@")
    after = scrape(metrics_port)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert grew("deltaserve_requests_finished_total", reason="length") == 2
    assert (
        grew("deltaserve_prompt_tokens_reused_total", source="snapshot")
        == second.usage.prompt_tokens_details.cached_tokens
    )
    assert (
        grew("deltaserve_executor_step_seconds_count") >= 4
        and grew("deltaserve_executor_step_seconds_sum") > 0
    )
    assert (
        grew("deltaserve_cache_park_seconds_count") == 1
        and grew("deltaserve_cache_restore_seconds_count") == 1
    )
    assert after[("deltaserve_cache_snapshots", ())] >= 1 and after[("deltaserve_cache_bytes", ())] > 0
    assert grew("deltaserve_http_responses_total", path="/v1/chat/completions", status="200") == 2
    assert grew("deltaserve_http_responses_total", path="/v1/models/{model}", status="404") == 1
    assert ("deltaserve_cache_checksum_failures_total", ()) in after and (
        "deltaserve_cache_evictions_total",
        (),
    ) in after


async def executor_takes_only_the_service_key(executor: str) -> None:
    """`up --api-keys`' executor answers its own planner alone: no key, and a tenant's, are UNAUTHENTICATED (its
    Restore would hand any tenant's parked conversation to whoever dialled its port)."""
    import grpc

    from protos import executor_pb2, executor_pb2_grpc
    from protos.rpc import open_channel

    for key in (None, ALICE):
        async with open_channel(executor, ChannelSecurity(api_key=key)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await executor_pb2_grpc.ExecutorStub(channel).Describe(
                    executor_pb2.DescribeRequest(), timeout=10
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value.details()


def _http_children(parent: int) -> list[int]:
    """The HTTP API's processes under `parent` (multiprocessing's spawned children, not its resource tracker)."""
    import os

    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            found.append(pid)
    return found


def a_worker_killed_is_started_again(up: Serving, http_port: int) -> None:
    """SIGKILL of one HTTP process of `up --http-workers 2`: logged, another started on the port, and every
    request answered again (one in two went nowhere, with the parent still healthy)."""
    import os
    import signal
    import time

    before = _http_children(up.process.pid)
    assert len(before) == 2, before
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + 120
    events = ("the HTTP API's process exited; starting another", "the HTTP API's process started again")
    for event in events:
        while not any(e["event"] == event for e in up.events()):
            assert time.monotonic() < deadline, f"no {event!r} line"
            time.sleep(0.2)
    assert len(set(_http_children(up.process.pid)) - {before[0]}) == 2
    for _ in range(6):
        assert httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=10).status_code == 200


def a_second_group_of_workers_on_the_port_is_refused(http_port: int, planner_port: int) -> None:
    """Workers share their port through SO_REUSEPORT: a second `http --workers` on it would have shared it
    silently (a third of the answers from the wrong planner); it is refused, naming the port."""
    from tests.cli_helpers import deltaserve

    argv = ["http", "--port", str(http_port), "--workers", "2", "--planner", f"127.0.0.1:{planner_port}"]
    done = deltaserve(*argv)
    assert done.returncode == 1 and f"port {http_port} is taken" in done.stderr, done.stderr
