"""How a request carries a key. Over HTTP, ``Authorization: Bearer <key>``, as OpenAI
clients send it; Triton's gRPC server matches request headers with a
``triton-grpc-protocol-`` prefix, so over gRPC ``triton-grpc-protocol-authorization:
Bearer <key>``. Shared by the servers that check keys and the clients that send them."""

from __future__ import annotations

import hmac
import os

HEADER = "authorization"
GRPC_HEADER = "triton-grpc-protocol-authorization"
# Where our processes find their keys: the environment, never a command line.
API_KEY_ENV = "PREBLE_API_KEY"  # what clients send
ADMIN_KEY_ENV = "PREBLE_ADMIN_KEY"  # the operator's: admin APIs, the router's admin control request
ENGINE_KEY_ENV = "PREBLE_ENGINE_KEY"  # what the router sends its engines


def bearer(key: str | None) -> dict[str, str]:
    """HTTP headers carrying ``key`` (none without one)."""
    return {HEADER: f"Bearer {key}"} if key else {}


def grpc_bearer(key: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``key`` (none without one)."""
    return ((GRPC_HEADER, f"Bearer {key}"),) if key else ()


def engine_key() -> str | None:
    """The key this process sends its engines (``PREBLE_ENGINE_KEY``), if any."""
    return os.environ.get(ENGINE_KEY_ENV) or None


def same_key(key: str | None, expected: str | None) -> bool:
    """Whether ``key`` is ``expected``, compared in constant time."""
    return key is not None and expected is not None and hmac.compare_digest(key.encode(), expected.encode())
