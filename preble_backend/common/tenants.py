"""Who a request is served for: tenants named by API key, in a keys file the operator owns.

One line per key::

    # key                           tenant    weight  options
    sk-team-a-6f1c0d8e2b7a4c95        team-a    1
    sk-team-b-0b9e3f5a7c2d4e81        team-b    2       max_in_flight=64 tokens_per_minute=200000
    sk-gateway-93a7e1c4d6b8f025       *                 # a gateway: its requests name their tenant

A key opens inference for its tenant only: the front sets the request parameters
``preble_tenant`` and ``preble_tenant_weight`` from the key, and refuses a request that
sets them itself. Only a key whose tenant is ``*`` (a gateway the operator runs, which
authenticates its own users) names the tenant, with the header ``preble-tenant``; the
tenant's weight is then its line's weight elsewhere in the file, or 1. ``max_in_flight``
caps a tenant's requests open at once through one front, ``tokens_per_minute`` the prompt
and output tokens all routers together serve it (``router/requests/token_budgets.py``):
over either, 429 with Retry-After.
A file with any bad line is refused at start, naming the line.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

from preble_backend.common.fair_share import DEFAULT_TENANT

TENANT_PARAMETER = "preble_tenant"
WEIGHT_PARAMETER = "preble_tenant_weight"
TPM_PARAMETER = "preble_tenant_tokens_per_minute"
TENANT_HEADER = "preble-tenant"
GATEWAY = "*"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
KEY = re.compile(r"[\x21-\x7e]{16,256}")  # printable ASCII, no spaces: what a Bearer header carries
OPTIONS = {"max_in_flight", "tokens_per_minute"}


class KeysFileError(ValueError):
    pass


class TenantRefused(Exception):
    """A request's tenant cannot be what it asked: ``status`` is the HTTP answer (403, 429)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    max_in_flight: int = 0  # 0: no cap
    tokens_per_minute: int = 0  # 0: no cap

    def terms(self) -> str:
        caps = {"max_in_flight": self.max_in_flight, "tokens_per_minute": self.tokens_per_minute}
        return " ".join([f"weight {self.weight:g}", *(f"{k}={v}" for k, v in caps.items() if v)])

    def parameters(self) -> dict[str, str]:
        """What the front sets on every request of this tenant (strings: every protocol
        carries them; Triton's double parameters are not in every client and backend)."""
        cap = {TPM_PARAMETER: str(self.tokens_per_minute)} if self.tokens_per_minute else {}
        return {TENANT_PARAMETER: self.name, WEIGHT_PARAMETER: f"{self.weight:g}", **cap}


def check_tenant_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{where} must be a tenant name: 1-64 letters, digits, '.', '_' or '-', "
                         f"starting with a letter or digit (got {name!r:.80})")  # fmt: skip
    return name


def check_weight(value: object, where: str) -> float:
    try:
        weight = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        weight = math.nan
    if isinstance(value, bool) or not math.isfinite(weight) or not 0 < weight <= 1e6:
        raise ValueError(f"{where} must be a number in (0, 1e6] (got {value!r:.80})")
    return weight


def _digest(key: str) -> bytes:
    """Keys are looked up by digest: no comparison of a guess against a key leaks its prefix."""
    return hashlib.sha256(key.encode()).digest()


class TenantKeys:
    """A keys file, read once: key digest -> the tenant it serves (``GATEWAY``: named by header)."""

    def __init__(self, keys: dict[str, Tenant]) -> None:
        self._by_digest = {_digest(key): tenant for key, tenant in keys.items()}
        self.tenants = {t.name: t for t in keys.values() if t.name != GATEWAY}

    @classmethod
    def load(cls, path: str | Path) -> TenantKeys:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise KeysFileError(f"keys file {path}: cannot be read ({exc})") from None
        keys: dict[str, Tenant] = {}
        seen: dict[str, tuple[Tenant, int]] = {}  # tenant -> as first named, on that line
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            try:
                key, tenant = _line(fields)
            except ValueError as exc:
                raise KeysFileError(f"keys file {path}, line {number}: {exc}") from None
            if key in keys:
                raise KeysFileError(f"keys file {path}, line {number}: this key is already on another line")
            first, on = seen.setdefault(tenant.name, (tenant, number))
            if tenant.name != GATEWAY and first != tenant:
                where = f"keys file {path}, line {number}"
                raise KeysFileError(f"{where}: tenant {tenant.name} has {tenant.terms()} here but "
                                    f"{first.terms()} on line {on}")  # fmt: skip
            keys[key] = tenant
        if not keys:
            raise KeysFileError(f"keys file {path}: no keys (one line per key: <key> <tenant> [weight])")
        return cls(keys)

    def holds(self, key: str | None) -> bool:
        return key is not None and _digest(key) in self._by_digest

    def tenant(self, key: str | None, header: str | None) -> Tenant | None:
        """The tenant a request with ``key`` (and the ``preble-tenant`` header's ``header``)
        is served for; None: the key is not in the file. A header from a tenant's own key
        is refused (403): only a gateway's key names tenants."""
        found = self._by_digest.get(_digest(key)) if key is not None else None
        if found is None:
            return None
        if found.name != GATEWAY:
            if header is not None:
                raise TenantRefused(403, f"header {TENANT_HEADER} is refused: this API key serves tenant "
                                         f"{found.name}, and only a gateway's key names tenants")  # fmt: skip
            return found
        if header is None:
            return self.tenants.get(DEFAULT_TENANT, Tenant(DEFAULT_TENANT))
        try:
            name = check_tenant_name(header, f"header {TENANT_HEADER}")
        except ValueError as exc:
            raise TenantRefused(400, str(exc)) from None
        caps = {"max_in_flight": found.max_in_flight, "tokens_per_minute": found.tokens_per_minute}
        return self.tenants.get(name, Tenant(name, **caps))


def _line(fields: list[str]) -> tuple[str, Tenant]:
    if len(fields) < 2:
        raise ValueError("expected <key> <tenant> [weight] [max_in_flight=N]")
    key, name, rest = fields[0], fields[1], fields[2:]
    if not KEY.fullmatch(key):
        raise ValueError("the key must be 16 to 256 printable characters without spaces")
    if name != GATEWAY:
        check_tenant_name(name, "the tenant")
    weight = 1.0
    if rest and "=" not in rest[0]:
        weight = check_weight(rest.pop(0), "the weight")
        if name == GATEWAY:
            raise ValueError("a gateway's line ('*') has no weight: its tenants' own lines give theirs")
    options: dict[str, int] = {}
    for option in rest:
        option_name, _, value = option.partition("=")
        if option_name not in OPTIONS:
            raise ValueError(f"unknown option {option!r:.80} (known: {', '.join(sorted(OPTIONS))})")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{option_name} must be a whole number of at least 1 (got {value!r:.40})")
        options[option_name] = int(value)
    return key, Tenant(name, weight, **options)
