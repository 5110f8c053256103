"""Prometheus metrics: one registry per process (`up` serves every service's on one port) and its port.

The exposition runs on prometheus-client's own thread (its WSGI server), so a scrape never waits on a
service's event loop; gauges of live state are read at scrape time (set_function), never pushed from a
step's path.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server


@dataclass(slots=True)
class MetricsServer:
    port: int
    _server: object

    def stop(self) -> None:
        self._server.shutdown()  # type: ignore[attr-defined]
        self._server.server_close()  # type: ignore[attr-defined]


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serves `registry` at http://host:port/metrics (0: a free port); OSError naming the port when taken."""
    try:
        server, _thread = start_http_server(port, host, registry)
    except OSError as error:
        raise OSError(f"cannot serve metrics on {host}:{port}: {error.strerror}") from error
    return MetricsServer(server.server_address[1], server)
