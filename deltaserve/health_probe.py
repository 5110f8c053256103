"""A container's health check: exit 0 when the service says SERVING on grpc.health.v1, 1 otherwise.

    python -m deltaserve.health_probe [HOST:PORT]     default 127.0.0.1:$DELTASERVE_PORT

The services configure themselves from DELTASERVE_* variables, so one probe fits each compose service:
it asks the port its own service listens on. Plaintext only (a TLS deployment probes with its own tool).
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def probe(address: str, timeout_s: float = 3.0) -> str:
    """The health status's name at `address` (SERVING, NOT_SERVING, ...), or why it could not be read."""
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str]) -> int:
    if argv:
        address = argv[0]
    elif port := os.environ.get("DELTASERVE_PORT"):
        address = f"127.0.0.1:{port}"
    else:
        print("health_probe: give HOST:PORT or set DELTASERVE_PORT", file=sys.stderr)
        return 2
    status = probe(address)
    print(f"{address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
