"""The front names every request's tenant (``common/tenants.py``) and caps each tenant's
requests in flight.

Without a keys file every request is the default tenant's and a ``preble-tenant`` header
is refused: nobody may name a tenant. With one, a client's key is looked up in it; the
request is sent on with the tenant's parameters, written over whatever the request said,
and with the front's own key to tritonserver (which no client holds), so a client can
neither name another tenant nor reach tritonserver around the front. A gRPC stream counts
as one request in flight, as an HTTP request does.
"""

from __future__ import annotations

from preble_backend.common.fair_share import DEFAULT_TENANT
from preble_backend.common.keys import HEADER, same_key
from preble_backend.common.tenants import TENANT_HEADER, Tenant, TenantKeys, TenantRefused
from preble_backend.frontend.triton_http import RETRY_AFTER_S


class TenantGate:
    def __init__(self, keys: TenantKeys | None = None) -> None:
        self.keys = keys
        self.in_flight: dict[str, int] = {}

    def is_client_key(self, key: str | None, api_key: str | None) -> bool:
        """Whether ``key`` is a client's: one of the keys file's, else the API key."""
        return self.keys.holds(key) if self.keys is not None else same_key(key, api_key)

    def open(self, api_key: str | None) -> bool:
        """Whether inference needs no key: neither a keys file nor an API key."""
        return self.keys is None and api_key is None

    def tenant(self, key: str | None, header: str | None) -> Tenant:
        """The tenant of a request whose key has been checked already."""
        if self.keys is None:
            if header is not None:
                message = "this server names no tenants (a keys file does: preble serve --keys-file)"
                raise TenantRefused(403, f"header {TENANT_HEADER} is refused: {message}")
            return Tenant(DEFAULT_TENANT)
        found = self.keys.tenant(key, header)
        if found is None:  # the key check comes first; this is a defect, not a client's error
            raise TenantRefused(401, "a valid API key is required")
        return found

    def admit(self, tenant: Tenant) -> None:
        """``tenant`` has one more request in flight (until ``release``); over its cap, 429."""
        now = self.in_flight.get(tenant.name, 0)
        if tenant.max_in_flight and now >= tenant.max_in_flight:
            cap = f"its cap (max_in_flight={tenant.max_in_flight} in the keys file)"
            raise TenantRefused(429, f"tenant {tenant.name} has {now} requests in flight: {cap}; retry later")
        self.in_flight[tenant.name] = now + 1

    def release(self, tenant: Tenant) -> None:
        left = self.in_flight[tenant.name] - 1
        if left:
            self.in_flight[tenant.name] = left
        else:  # a gateway names tenants at will: none is kept once it has nothing in flight
            del self.in_flight[tenant.name]


def add_http_gate(app, key: str | None, tenants: TenantGate, open_paths: tuple[str, ...]) -> None:
    """Every HTTP request but a probe (``open_paths``) needs a client key (``key``, or any
    of the keys file's); its tenant goes in ``request.state.tenant``, and a POST (an
    inference request) is the tenant's in flight until the last byte of its answer."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from preble_backend.frontend.openai_protocol import OpenAIError

    def refused(request: Request, status: int, message: str) -> JSONResponse:
        openai = request.url.path.startswith("/v1/")
        body = OpenAIError(status, message).body() if openai else {"error": message}
        retry = {"Retry-After": RETRY_AFTER_S} if status == 429 else None
        return JSONResponse(body, status_code=status, headers=retry)

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if request.url.path in open_paths:
            return await call_next(request)
        sent = request.headers.get(HEADER, "")
        given = sent[len("Bearer ") :] if sent.startswith("Bearer ") else None
        if not (tenants.open(key) or tenants.is_client_key(given, key)):
            message = "a valid API key is required: send the header 'Authorization: Bearer <key>'"
            return refused(request, 401, message)
        try:
            request.state.tenant = tenant = tenants.tenant(given, request.headers.get(TENANT_HEADER))
            if request.method != "POST":
                return await call_next(request)
            tenants.admit(tenant)
        except TenantRefused as exc:
            return refused(request, exc.status, str(exc))
        try:
            response = await call_next(request)
        except BaseException:
            tenants.release(tenant)
            raise
        body = response.body_iterator

        async def released():  # in flight until the answer's last byte
            try:
                async for chunk in body:
                    yield chunk
            finally:
                tenants.release(tenant)

        response.body_iterator = released()
        return response
