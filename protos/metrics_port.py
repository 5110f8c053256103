"""Prometheus metrics: one registry per process (`up` serves every service's on one port) and its port.

The exposition runs on threads of its own (prometheus-client's WSGI app on a threading WSGI server), so a scrape
never waits on a service's event loop; gauges of live state are read at scrape time (set_function), never
pushed from a step's path.

The port takes no API key (Prometheus scrapes send none): what it shows is the whole service's (the cache's:
every tenant's snapshot count and bytes), so it listens where --metrics-host says, loopback by default. A service
with TLS serves it over TLS with the same certificate (and, with --tls-client-ca, requires a client certificate
as its own port does). Each connection's handshake runs on that connection's thread, under a timeout:
prometheus-client's own TLS option shakes hands in the accepting thread, where one connection that never sends
its hello stops every scrape after it. Plain or TLS, each read and write of a connection has that timeout too: a
client that connects and says nothing is dropped, not left holding its thread for ever, and so is one that does
not read its answer (the write times out), quietly: no traceback on stderr.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import sys
import threading
from dataclasses import dataclass
from typing import IO, cast
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from protos.tls import ServerTLS

CONNECTION_TIMEOUT_S = 10.0  # a connection's TLS handshake, and each read and write (plain or TLS)


@dataclass(slots=True)
class MetricsServer:
    port: int
    _server: WSGIServer

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _ServerHandler(ServerHandler):
    request_handler: WSGIRequestHandler  # wsgiref's back pointer, for its log_request

    def handle_error(self) -> None:
        """A client too slow to read the answer (the write timed out) or gone: nobody to answer, nothing to print
        (wsgiref prints the traceback of any error but a few resets). Any other error is still printed."""
        if isinstance(sys.exc_info()[1], (TimeoutError, ConnectionError, ssl.SSLError)):
            return
        super().handle_error()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # a line per scrape on stderr: not wanted
        pass

    def handle(self) -> None:
        """wsgiref's, with the handler above (wsgiref names its own class here, no attribute to set)."""
        self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.requestline = self.request_version = self.command = ""
            self.send_error(414)
            return
        if not self.parse_request():  # an error code has been sent
            return
        output = cast(IO[bytes], self.wfile)
        handler = _ServerHandler(self.rfile, output, self.get_stderr(), self.get_environ(), multithread=False)
        handler.request_handler = self
        app = cast(WSGIServer, self.server).get_app()
        assert app is not None  # make_server set it
        handler.run(app)


class _MetricsHTTPServer(ThreadingWSGIServer):
    tls: ssl.SSLContext | None = None
    timeout_s: float = CONNECTION_TIMEOUT_S

    def finish_request(self, request, client_address) -> None:
        """On the connection's own thread: its TLS handshake first, where the server has TLS. A client that fails
        it (plaintext HTTP, an untrusted or missing client certificate, silence past the timeout) is dropped, as
        is one silent past the timeout after (wsgiref would print the timeout's traceback)."""
        request.settimeout(self.timeout_s)
        if self.tls is None:
            with contextlib.suppress(TimeoutError):
                super().finish_request(request, client_address)
            return
        try:
            connection = self.tls.wrap_socket(request, server_side=True)  # takes over (detaches) `request`
        except (OSError, ValueError):
            return
        try:
            with contextlib.suppress(TimeoutError):
                super().finish_request(connection, client_address)
        finally:
            connection.close()


def tls_context(tls: ServerTLS) -> ssl.SSLContext:
    """The server side of TLS with the service's certificate; a client certificate required with a client CA."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert, tls.key)
    if tls.client_ca is not None:
        context.load_verify_locations(tls.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _family(host: str, port: int) -> socket.AddressFamily:
    """IPv4 or IPv6, as the host resolves for listening."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return infos[0][0]


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    tls: ServerTLS | None = None,
    *,
    timeout_s: float = CONNECTION_TIMEOUT_S,
) -> MetricsServer:
    """Serves `registry` at http://host:port/metrics (https:// with `tls`; 0: a free port); OSError naming the
    address when it cannot listen there. `timeout_s`: a connection's handshake, and each read and write."""
    context = tls_context(tls) if tls is not None else None
    try:
        settings = {"address_family": _family(host, port), "tls": context, "timeout_s": timeout_s}
        server_class = type("MetricsHTTPServer", (_MetricsHTTPServer,), settings)
        server: WSGIServer = make_server(
            host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler
        )
    except OSError as error:
        raise OSError(f"cannot serve metrics on {host}:{port}: {error.strerror or error}") from error
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return MetricsServer(server.server_address[1], server)
