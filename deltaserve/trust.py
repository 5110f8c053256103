"""What the serving commands' trust flags mean: TLS on their ports, API keys, and how each service reaches
the others (TLS, the cache's service key); and what a client command sends."""

from __future__ import annotations

import argparse
import secrets
from dataclasses import dataclass, field

from protos.auth import SERVICE, ApiKeys, Caller, KeyFileError, load_keys, parse_keys
from protos.rpc import ChannelSecurity, ServerSecurity
from protos.tls import ClientTLS, check_roots, server_tls


@dataclass(frozen=True, slots=True)
class Trust:
    server: ServerSecurity = field(default_factory=ServerSecurity)  # this process's ports
    executor_link: ChannelSecurity = field(default_factory=ChannelSecurity)  # the planner's to executors
    cache_link: ChannelSecurity = field(default_factory=ChannelSecurity)  # to the cache: TLS, service key
    self_link: ChannelSecurity = field(default_factory=ChannelSecurity)  # to its own port (its checks)
    executor_keys: ApiKeys | None = None  # what an executor's port takes: service keys only (None: open)

    @property
    def planner_link(self) -> ChannelSecurity:
        """The HTTP gateway's to a planner: TLS as to the other services, no key of its own (it forwards
        each caller's)."""
        return ChannelSecurity(tls=self.executor_link.tls)

    @property
    def executor_server(self) -> ServerSecurity:
        """The executor's port: TLS (mTLS with --tls-client-ca) and, where keys are set, the service keys alone:
        its callers are planners, and a tenant reaching it directly could read any tenant's snapshot."""
        return ServerSecurity(tls=self.server.tls, keys=self.executor_keys)

    @property
    def executor_open(self) -> bool:
        """Whoever reaches the executor's port is served: it takes no keys and asks for no client certificate."""
        tls = self.server.tls
        return self.executor_keys is None and (tls is None or tls.client_ca is None)


def with_service_key(keys: ApiKeys, key: str) -> ApiKeys:
    """The keys and one more service key (`up`: its own planner and executor reach its cache with it)."""
    extra = parse_keys(f"{key} {SERVICE}\n", "the in-process service key")
    assert extra.caller(key) == Caller(None)
    return ApiKeys({**keys._callers, **extra._callers}, keys.source)


def trust_from_args(args: argparse.Namespace) -> Trust:
    """The trust settings of a serving command; ValueError (KeyFileError, TLSConfigError) saying what is
    wrong with a key file or a certificate flag."""
    tls = server_tls(
        getattr(args, "tls_cert", None), getattr(args, "tls_key", None), getattr(args, "tls_client_ca", None)
    )
    keys = load_keys(args.api_keys) if getattr(args, "api_keys", None) else None
    if tls is not None:
        tls.credentials()  # read the files now: a missing one fails the start, naming it
        tls.check()
    ca = getattr(args, "tls_ca", None)
    if ca is not None:
        check_roots(ca, "--tls-ca")
    cache_key = getattr(args, "cache_api_key", None)
    executor_key = getattr(args, "executor_api_key", None)
    if args.command == "up" and keys is not None and cache_key is not None and args.cache == "auto":
        caller = keys.caller(cache_key)
        if caller is None or not caller.service:  # the cache up starts takes --api-keys' service keys
            raise KeyFileError(f"--cache-api-key is not a service key (a `* ` line) of {keys.source}")
    if args.command == "up" and keys is not None:
        # Its planner's key to its own executor (and stages), and to the cache it starts: this process's alone.
        executor_key = secrets.token_urlsafe(32)
        keys = with_service_key(keys, executor_key)
        if cache_key is None and args.cache == "auto":
            cache_key = executor_key
    if args.command == "up" and tls is not None and ca is None:
        ca = tls.cert  # its own services: a self-signed --tls-cert is its own root
    link_tls = None
    if ca is not None:
        own_cert = tls.cert if tls is not None else None
        link_tls = ClientTLS(ca=ca, cert=own_cert, key=tls.key if tls is not None else None)
    self_tls = None
    if tls is not None:
        self_tls = ClientTLS(ca=ca or tls.cert, cert=tls.cert, key=tls.key)
    if args.command == "executor" and keys is not None and not len(keys.services()):
        raise KeyFileError(f"{keys.source} has no service key (a `* ` line): an executor takes no other")
    return Trust(
        server=ServerSecurity(tls=tls, keys=keys),
        executor_link=ChannelSecurity(tls=link_tls, api_key=executor_key),
        cache_link=ChannelSecurity(tls=link_tls, api_key=cache_key),
        self_link=ChannelSecurity(tls=self_tls),
        executor_keys=keys.services() if keys is not None else None,
    )


def client_security(args: argparse.Namespace) -> ChannelSecurity:
    """A client command's channel: TLS when --tls-ca is given (with a client certificate when given), and
    its --api-key."""
    tls = None
    if args.tls_ca:
        check_roots(args.tls_ca, "--tls-ca")
    if args.tls_ca or args.tls_cert or args.tls_key:
        tls = ClientTLS(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
    return ChannelSecurity(tls=tls, api_key=args.api_key or None)
