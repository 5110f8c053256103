"""The metrics port's exposure, over real sockets on loopback: it listens on --metrics-host (loopback by default,
whatever --host is), and on a service with TLS it speaks TLS only (the service's certificate; a client
certificate where the service requires them), each handshake on its connection's own thread; a client too slow
to read is dropped quietly. And the serving
flags refused at parse time: two listening flags on one port, --http-workers with --no-http-process."""

from __future__ import annotations

import http.client
import signal
import socket
import ssl
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Gauge

from protos.metrics_port import serve_metrics
from protos.tls import ServerTLS
from tests.certs import make_pki
from tests.cli_helpers import Serving, free_port, parse, usage_error


def get(port: int, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    """GET /metrics on 127.0.0.1:port, HTTPS with `context` (plain HTTP without): status and body; raises where
    the server hangs up instead of answering."""
    if context is None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    else:
        connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
    try:
        connection.request("GET", "/metrics")
        answer = connection.getresponse()
        return answer.status, answer.read().decode()
    finally:
        connection.close()


def scrape(port: int, context: ssl.SSLContext | None = None) -> str:
    status, text = get(port, context)
    assert status == 200
    return text


def _cache_serve(tmp_path, port: int, metrics_port: int, *flags: str) -> Serving:
    """`deltaserve cache serve` on `port`, its metrics on `metrics_port`, with `flags`."""
    snapshots = str(tmp_path / "snapshots")
    return Serving(
        tmp_path / "cache.log",
        "cache",
        "serve",
        "--cache-dir",
        snapshots,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        *flags,
    )


def test_a_tls_service_serves_its_metrics_over_tls_only(tmp_path):
    """`cache serve` with keys and TLS: its metrics (every tenant's snapshot totals) answer HTTPS with its
    certificate, and a plaintext scrape, which used to get them with no key, is refused."""
    pki = make_pki(str(tmp_path))
    keys = tmp_path / "keys.txt"
    keys.write_text("k-alice-0123456789abcdef alice\n")
    port, metrics_port = free_port(), free_port()
    tls = ("--api-keys", str(keys), "--tls-cert", pki.server.cert, "--tls-key", pki.server.key)
    serving = _cache_serve(tmp_path, port, metrics_port, *tls)
    try:
        listening = serving.wait_listening(60)
        assert listening["metrics"] == f"127.0.0.1:{metrics_port}"
        with pytest.raises((http.client.HTTPException, OSError)):  # the TLS server hangs up on it
            get(metrics_port)
        with pytest.raises(ssl.SSLCertVerificationError):  # the service's own certificate, nothing else
            get(metrics_port, ssl.create_default_context(cafile=pki.other_ca.cert))
        text = scrape(metrics_port, ssl.create_default_context(cafile=pki.ca.cert))
        assert "deltaserve_cache_snapshots 0.0" in text and "deltaserve_cache_bytes 0.0" in text
    finally:
        code = serving.stop(signal.SIGTERM)
    assert code == 0, serving.log_path.read_text()


def test_the_metrics_port_listens_on_loopback_unless_told_otherwise(tmp_path):
    """--host is the API's address; the metrics port takes no key, so it stays on 127.0.0.1 (it used to follow
    --host: 0.0.0.0 in compose) unless --metrics-host (DELTASERVE_METRICS_HOST) says otherwise."""
    for command in (["up"], ["executor"], ["planner", "--executor", "e:1"], ["cache", "serve"], ["http"]):
        assert parse([*command, "--host", "0.0.0.0"]).metrics_host == "127.0.0.1"
        assert parse(command, DELTASERVE_METRICS_HOST="10.0.0.7").metrics_host == "10.0.0.7"
        assert parse([*command, "--metrics-host", "::1"]).metrics_host == "::1"
    port, metrics_port = free_port(), free_port()
    # another loopback address: what --host binds, the metrics port must not
    serving = _cache_serve(tmp_path, port, metrics_port, "--host", "127.0.0.2")
    try:
        listening = serving.wait_listening(60)
        assert (listening["addr"], listening["metrics"]) == (
            f"127.0.0.2:{port}",
            f"127.0.0.1:{metrics_port}",
        )
        assert "deltaserve_cache_snapshots" in scrape(metrics_port)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", metrics_port), timeout=10).close()
    finally:
        code = serving.stop(signal.SIGTERM)
    assert code == 0, serving.log_path.read_text()


def test_tls_metrics_require_a_client_certificate_with_a_client_ca_and_shake_hands_off_the_accept_thread(
    tmp_path,
):
    """With --tls-client-ca the metrics port requires a client certificate, as the service's port does. A
    connection that never sends its TLS hello holds only its own thread: prometheus-client's own TLS shakes
    hands in the accepting thread, where such a connection stopped every scrape after it."""
    pki = make_pki(str(tmp_path))
    registry = CollectorRegistry()
    Gauge("deltaserve_test_gauge", "a figure", registry=registry).set(7)
    tls = ServerTLS(pki.server.cert, pki.server.key, pki.ca.cert)
    served = serve_metrics(registry, "127.0.0.1", 0, tls, timeout_s=120.0)  # the idle one outlives the join
    idle = socket.create_connection(("127.0.0.1", served.port), timeout=10)  # connected, never says a word
    try:
        without = ssl.create_default_context(cafile=pki.ca.cert)
        with pytest.raises(OSError):  # the handshake fails, or the server hangs up before the answer
            get(served.port, without)
        with_cert = ssl.create_default_context(cafile=pki.ca.cert)
        with_cert.load_cert_chain(pki.client.cert, pki.client.key)
        answers: list[str] = []
        scraping = threading.Thread(
            target=lambda: answers.append(scrape(served.port, with_cert)), daemon=True
        )
        scraping.start()
        scraping.join(60)  # less than the server's handshake timeout: the idle connection is still held
        assert answers and "deltaserve_test_gauge 7.0" in answers[0]
    finally:
        idle.close()
        served.stop()


def test_a_silent_plain_connection_is_dropped_after_the_timeout_and_scrapes_go_on(capfd):
    """A plaintext client that connects and sends nothing held its server thread for ever (the timeout was the
    TLS handshake's alone); now it is hung up on once the connection's timeout passes, quietly, and scrapes
    meanwhile are answered."""
    registry = CollectorRegistry()
    Gauge("deltaserve_test_gauge", "a figure", registry=registry).set(7)
    served = serve_metrics(registry, "127.0.0.1", 0, timeout_s=0.5)
    idle = socket.create_connection(("127.0.0.1", served.port), timeout=10)  # connected, never says a word
    try:
        connected = time.monotonic()
        assert "deltaserve_test_gauge 7.0" in scrape(served.port)
        idle.settimeout(5)
        assert idle.recv(1) == b""  # the server hung up (a timeout here: it still holds the connection)
        assert time.monotonic() - connected < 5
        assert "deltaserve_test_gauge 7.0" in scrape(served.port)
    finally:
        idle.close()
        served.stop()
    assert "Traceback" not in capfd.readouterr().err


def _request_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "process_request" in t.name]


def test_a_client_not_reading_a_large_answer_is_dropped_quietly(capfd):
    """A client that asks and does not read the answer (16 MiB, beyond the socket buffers): the server's write
    times out and it hangs up, without the traceback wsgiref printed for it on stderr; scrapes go on."""
    registry = CollectorRegistry()
    Gauge("deltaserve_test_gauge", "a figure", ["label"], registry=registry).labels("x" * (16 << 20)).set(7)
    served = serve_metrics(registry, "127.0.0.1", 0, timeout_s=0.5)
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    try:
        slow.connect(("127.0.0.1", served.port))
        slow.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        deadline = time.monotonic() + 30
        while not _request_threads():  # the server's thread for it, writing
            assert time.monotonic() < deadline
            time.sleep(0.01)
        while _request_threads():  # until its write timed out and it hung up
            assert time.monotonic() < deadline, "the server still writes to a client that does not read"
            time.sleep(0.05)
    finally:
        slow.close()
        served.stop()
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["cache", "serve", "--port", "9100", "--metrics-port", "9100"], ("--port", "--metrics-port")),
        (
            ["executor", "--host", "0.0.0.0", "--port", "9100", "--metrics-port", "9100"],
            ("--port", "--metrics-port"),
        ),
        (["http", "--metrics-port", "8000"], ("--port", "--metrics-port")),  # http's --port is 8000
        (["up", "--http-port", "50051"], ("--port", "--http-port")),
        (["up", "--http-port", "50071"], ("--http-port", "--cache-port")),  # the cache up starts: 50071
        (["up", "--metrics-port", "9100", "--http-port", "9100"], ("--http-port", "--metrics-port")),
        (["up", "--cache-port", "9100", "--metrics-port", "9100"], ("--cache-port", "--metrics-port")),
    ],
)
def test_two_listening_flags_on_one_port_are_refused_naming_both(capsys, argv, named):
    """The second listener would only fail at start with "port taken", not saying that this process took it."""
    message = usage_error(capsys, argv)
    assert all(flag in message for flag in named), message
    assert "are both" in message


def test_ports_that_cannot_collide_are_taken():
    assert parse(["up", "--port", "0", "--http-port", "0", "--cache-port", "0", "--metrics-port", "0"])
    assert parse(["up", "--no-cache", "--http-port", "50071"]).http_port == 50071  # no cache: no cache port
    # The same number on two addresses: two sockets (the metrics port on loopback, the API elsewhere).
    assert parse(["executor", "--host", "10.0.0.7", "--port", "9100", "--metrics-port", "9100"])


def test_http_workers_with_no_http_process_is_refused(capsys):
    """--no-http-process serves the HTTP API on the planner's loop: --http-workers N was dropped without a word."""
    for argv, environ in (
        (["up", "--http-port", "8000", "--no-http-process", "--http-workers", "4"], {}),
        (["up", "--http-port", "8000", "--http-workers", "4"], {"DELTASERVE_HTTP_PROCESS": "0"}),
    ):
        message = usage_error(capsys, argv, **environ)
        assert "--http-workers 4" in message and "--no-http-process" in message, message
    assert parse(["up", "--no-http-process"]).http_workers == 1
    assert parse(["up", "--http-workers", "4"]).http_process
