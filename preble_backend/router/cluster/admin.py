"""The router's admin control requests: switch the policy, flush every engine's cache,
read the router's state, all without loading a model.

Why a request and not Triton's model-control API: reloading the router with a
configuration override needs ``--model-control-mode=explicit``, and a server that loads
models on request also loads a model with a ``file:`` override, which runs uploaded code.
The stack's servers run with model control ``none``; what an operator changes at run time
goes through here, as request parameters on the router's ordinary inference API:

- ``preble_admin``: the operation, one of ``OPS``;
- ``preble_admin_key``: the admin key (``PREBLE_ADMIN_KEY`` in the router's environment;
  never the API key, which clients hold);
- ``preble_policy`` (``configure``): the policy to switch to.

A request without the right key is refused by name (the front answers 403).
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

from preble_backend.common.keys import ADMIN_KEY_ENV
from preble_backend.serving.protocol import FORBIDDEN, BadRequest
from scheduler.policies import POLICIES

OPS = ("status", "flush", "configure")


class AdminRefused(BadRequest):
    """A control request without the admin key."""


@dataclass(frozen=True)
class AdminRequest:
    op: str
    policy: str | None = None  # configure: the policy to switch to


def parse_admin(params: dict, admin_key: str | None) -> AdminRequest:
    """The control request in ``params`` (the request's parameters), checked: the key
    first, so that nothing about the router's state answers a caller without it."""
    given = params.get("preble_admin_key")
    if admin_key is None:
        raise AdminRefused(f"{FORBIDDEN}, and this router has none ({ADMIN_KEY_ENV} is not set)")
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), admin_key.encode()):
        raise AdminRefused(f"{FORBIDDEN} (request parameter preble_admin_key)")
    op = params.get("preble_admin")
    if op not in OPS:
        raise BadRequest(f"request parameter preble_admin={op!r} is invalid: expected one of "
                         f"{', '.join(OPS)}")  # fmt: skip
    policy = params.get("preble_policy")
    if op == "configure" and policy not in POLICIES:
        raise BadRequest(f"request parameter preble_policy={policy!r} is invalid: expected one of "
                         f"{', '.join(POLICIES)}")  # fmt: skip
    return AdminRequest(op, policy if op == "configure" else None)


def router_admin_key() -> str | None:
    return os.environ.get(ADMIN_KEY_ENV) or None
