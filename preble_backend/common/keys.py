"""How a request carries a key. Over HTTP, ``Authorization: Bearer <key>``, as OpenAI
clients send it; Triton's gRPC server matches request headers with a
``triton-grpc-protocol-`` prefix, so over gRPC ``triton-grpc-protocol-authorization:
Bearer <key>``. Shared by the servers that check keys and the clients that send them."""

from __future__ import annotations

HEADER = "authorization"
GRPC_HEADER = "triton-grpc-protocol-authorization"


def bearer(key: str | None) -> dict[str, str]:
    """HTTP headers carrying ``key`` (none without one)."""
    return {HEADER: f"Bearer {key}"} if key else {}


def grpc_bearer(key: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``key`` (none without one)."""
    return ((GRPC_HEADER, f"Bearer {key}"),) if key else ()
