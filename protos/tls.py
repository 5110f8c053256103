"""TLS settings of a server and of a client, read into gRPC credentials (PEM files).

A server with `client_ca` requires a client certificate signed by it (mTLS). A client trusts `ca` (the
system's roots when None) and presents `cert`/`key` when given (to a server that requires one).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc


class TLSConfigError(ValueError):
    """A certificate or key file that cannot be read, or a half-given pair."""


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise TLSConfigError(f"cannot read the {what} {path}: {error.strerror or error}") from error


def check_roots(path: str, flag: str) -> None:
    """TLSConfigError naming the flag and file where `path` holds no CA certificate a TLS context can load
    (gRPC would only fail each handshake: a server reads as a port taken, a client waits on for ever)."""
    import ssl

    _read(path, "TLS CA")  # a file that is not there, said as such
    try:
        ssl.create_default_context(cafile=path)
    except (ssl.SSLError, OSError, ValueError) as error:
        raise TLSConfigError(f"{flag} {path} is not a file of PEM CA certificates: {error}") from None


@dataclass(frozen=True, slots=True)
class ServerTLS:
    cert: str  # PEM certificate chain
    key: str  # PEM private key
    client_ca: str | None = None  # PEM roots a client certificate must chain to (mTLS); None: no client cert

    def check(self) -> None:
        """TLSConfigError naming the files where the key is not the certificate's (gRPC would only fail to
        listen, which reads as a port taken)."""
        import ssl

        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as error:
            raise TLSConfigError(
                f"--tls-cert {self.cert} and --tls-key {self.key} are not a certificate and its key: {error}"
            ) from None
        if self.client_ca is not None:
            check_roots(self.client_ca, "--tls-client-ca")

    def credentials(self) -> grpc.ServerCredentials:
        pair = (_read(self.key, "TLS key"), _read(self.cert, "TLS certificate"))
        roots = _read(self.client_ca, "client CA") if self.client_ca else None
        return grpc.ssl_server_credentials(
            [pair], root_certificates=roots, require_client_auth=roots is not None
        )


@dataclass(frozen=True, slots=True)
class ClientTLS:
    ca: str | None = None  # PEM roots the server's certificate must chain to; None: the system's
    cert: str | None = None  # the client's own certificate, for a server that requires one
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TLSConfigError("a client certificate needs both its certificate and its key")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "TLS CA") if self.ca else None,
            private_key=_read(self.key, "TLS key") if self.key else None,
            certificate_chain=_read(self.cert, "TLS certificate") if self.cert else None,
        )


def server_tls(cert: str | None, key: str | None, client_ca: str | None = None) -> ServerTLS | None:
    """A server's TLS from its flags: None when neither --tls-cert nor --tls-key is given."""
    if cert is None and key is None:
        if client_ca is not None:
            raise TLSConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise TLSConfigError("TLS needs both --tls-cert and --tls-key")
    return ServerTLS(cert, key, client_ca)
