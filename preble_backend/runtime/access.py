"""Who may reach a tritonserver, and with which key.

Triton 2.51 listens on every interface and restricts nothing unless told. A server
started here binds its HTTP, gRPC and metrics listeners to ``host`` (loopback unless the
operator asks) and restricts its APIs with Triton's own ``--http-restricted-api`` /
``--grpc-restricted-protocol``: the model-repository, logging and trace APIs always (a
load with a ``file:`` override runs the uploaded code as the server's user), everything
but health when there is an API key. How a request carries the key:
``common/keys.py``.

Our own processes get keys from the environment (``PREBLE_API_KEY``: what clients send;
``PREBLE_ENGINE_KEY``: what the router sends its engines), not their command lines;
tritonserver takes its rules only as arguments, so a local user who can read
``/proc/<pid>/cmdline`` can read them there (docs/SECURITY.md).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from preble_backend.common.keys import HEADER
from preble_backend.model.tiny_model import cache_root

# Shared-memory registration is admin: it makes the server map memory a client names.
ADMIN_APIS = ("model-repository", "logging", "trace", "shared-memory")
CLIENT_APIS = ("inference", "metadata", "model-config", "statistics")
LOOPBACK = "127.0.0.1"


def new_key() -> str:
    """192 random bits in hex: a URL-safe key may start with "-", which a command line's
    parser then reads as an option (``--admin-key -Xy...`` fails, 1 key in 64)."""
    return secrets.token_hex(24)


@dataclass(frozen=True)
class Access:
    """A server's listening address and keys. ``api_key``: what every client request but
    a health probe must carry (None: inference is open to whoever reaches ``host``);
    ``admin_key``: what loading and unloading models, changing the log or trace
    settings must carry (random unless given: then only this process knows it)."""

    host: str = LOOPBACK
    api_key: str | None = None
    admin_key: str = field(default_factory=new_key)
    http_host: str | None = None  # HTTP's own address (loopback: only the front reaches it)
    grpc_host: str | None = None  # gRPC's own address (loopback: only the front reaches it)
    metrics_host: str | None = None  # the metrics' own address (loopback: the front federates them)

    def server_args(self) -> list[str]:
        args = [f"--http-address={self.http_host or self.host}",
                f"--grpc-address={self.grpc_host or self.host}",
                f"--metrics-address={self.metrics_host or self.host}"]  # fmt: skip
        if self.admin_key == self.api_key:
            raise ValueError("the admin key must differ from the API key: clients hold the API key")
        groups = {self.admin_key: list(ADMIN_APIS)}
        if self.api_key is not None:
            groups[self.api_key] = list(CLIENT_APIS)
        for key, apis in groups.items():
            rule = f"{','.join(apis)}:{HEADER}=Bearer {key}"
            args += [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]
        return args

    @property
    def client_host(self) -> str:
        """Where a client on this machine reaches the server."""
        return LOOPBACK if self.host in ("0.0.0.0", "::", "") else self.host


def admin_key_file(grpc_port: int) -> Path:
    """Where ``preble serve`` leaves the admin key it made for the server on ``grpc_port``
    (readable by its user only), for ``preble bench`` to switch policies with."""
    return cache_root() / "keys" / f"admin-{grpc_port}"


def write_admin_key(grpc_port: int, key: str) -> Path:
    path = admin_key_file(grpc_port)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(key)
    return path


def read_admin_key(grpc_port: int) -> str | None:
    try:
        return admin_key_file(grpc_port).read_text().strip() or None
    except OSError:
        return None
