"""Triton's gRPC API, served by the front instead of by tritonserver itself.

Why: tritonserver's gRPC server answers a missing or wrong key with ``UNAVAILABLE``
("This protocol is restricted"), the status every gRPC client retries, so a client with a
bad key retries forever; it reports ready with every engine dead; and it is one more
parser of client bytes in the process that holds every stream. Here the router's
tritonserver listens for gRPC on loopback at a port only the front knows, and the front
relays each call's messages as bytes after deciding who may make it (an inference
request is parsed only to write its tenant's parameters over its own: ``tenant_gate.py``):

- a health probe (``ServerLive``, ``ServerReady``, ``ModelReady``) is open, and readiness
  is honest as on HTTP (``EngineView``);
- no key or an unknown one is ``UNAUTHENTICATED``; a known key on an API it does not open
  (the API key on an admin API, the admin key on inference) is ``PERMISSION_DENIED``;
  loading or unloading a model is ``PERMISSION_DENIED`` with any key (model control is
  ``none``);
- a message over ``--max-body-bytes`` is ``RESOURCE_EXHAUSTED`` (gRPC's own limit);
- a unary refusal that says "retry" is ``UNAVAILABLE``, one that says the request is bad
  ``INVALID_ARGUMENT``; a stream's own error messages pass through unchanged;
- a call whose upstream dies ends ``UNAVAILABLE`` naming the cause, never as a clean end;
  draining, new calls get ``UNAVAILABLE`` and open ones end with the drain's message.

Keys come as Triton's ``triton-grpc-protocol-authorization: Bearer <key>`` or as the plain
``authorization`` gRPC clients send; tritonserver gets the former, and still checks it
(with a keys file, it gets the front's own key). A tenant over its cap of requests in
flight is ``RESOURCE_EXHAUSTED``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import contextmanager

import grpc
from grpc import aio

from preble_backend.common.keys import GRPC_HEADER, HEADER, same_key
from preble_backend.common.tenants import TENANT_HEADER, Tenant, TenantRefused
from preble_backend.frontend.drain import MESSAGE, Drain
from preble_backend.frontend.tenant_gate import TenantGate
from preble_backend.frontend.triton_http import LOST, NO_MODEL_CONTROL, EngineView
from preble_backend.serving.protocol import invalid, rate_limited, retryable

SERVICE = "/inference.GRPCInferenceService/"
HEALTH = {"ServerLive", "ServerReady", "ModelReady"}
CLIENT = {
    "ServerMetadata",
    "ModelMetadata",
    "ModelInfer",
    "ModelStreamInfer",
    "ModelConfig",
    "ModelStatistics",
}
ADMIN = {"RepositoryIndex", "SystemSharedMemoryStatus", "SystemSharedMemoryRegister",
         "SystemSharedMemoryUnregister", "CudaSharedMemoryStatus", "CudaSharedMemoryRegister",
         "CudaSharedMemoryUnregister", "TraceSetting", "LogSettings"}  # fmt: skip
MODEL_CONTROL = {"RepositoryModelLoad", "RepositoryModelUnload"}
FORWARDED = {"triton_grpc_error"}  # Triton's switch for ending a stream on its first error
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


INFERENCE = {"ModelInfer", "ModelStreamInfer"}
REFUSED = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           403: grpc.StatusCode.PERMISSION_DENIED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED}  # fmt: skip


class Gate:
    """Which key opens what: the API key the client APIs (open without one), or with a
    keys file any of its keys; the admin key the admin APIs. Compared in constant time."""

    def __init__(self, api_key: str | None, admin_key: str | None, tenants: TenantGate | None = None) -> None:
        self.api_key, self.admin_key = api_key, admin_key
        self.tenants = tenants or TenantGate()

    def upstream_key(self, key: str | None) -> str | None:
        """The key tritonserver gets: the front's own where a keys file names tenants."""
        keyed = self.tenants.keys is not None and self.tenants.is_client_key(key, self.api_key)
        return self.api_key if keyed else key

    def refusal(self, name: str, key: str | None) -> tuple[grpc.StatusCode, str] | None:
        """Why the call ``name`` with ``key`` is refused, or None."""
        if name in HEALTH:
            return None
        if name in MODEL_CONTROL:
            return grpc.StatusCode.PERMISSION_DENIED, NO_MODEL_CONTROL
        is_api, is_admin = self.tenants.is_client_key(key, self.api_key), same_key(key, self.admin_key)
        if name in CLIENT:
            if is_api or self.tenants.open(self.api_key):
                return None
            if is_admin:
                return grpc.StatusCode.PERMISSION_DENIED, f"{name} needs the API key, not the admin key"
            return grpc.StatusCode.UNAUTHENTICATED, (
                f"{name} needs a valid API key: send the metadata '{GRPC_HEADER}: Bearer <key>'"
            )
        if name in ADMIN:
            if is_admin:
                return None
            if is_api:
                return grpc.StatusCode.PERMISSION_DENIED, f"{name} is an admin API: it needs the admin key"
            return grpc.StatusCode.UNAUTHENTICATED, f"{name} is an admin API: it needs the admin key"
        return grpc.StatusCode.UNIMPLEMENTED, f"unknown method {name}"


def _key(metadata) -> str | None:
    """The bearer key a call carries, in Triton's header or the plain one."""
    found = dict(metadata or ())
    value = found.get(GRPC_HEADER) or found.get(HEADER) or ""
    return value[len("Bearer ") :] if value.startswith("Bearer ") else None


class GrpcFront(grpc.GenericRpcHandler):
    """Every method of ``inference.GRPCInferenceService``, relayed to ``upstream``."""

    def __init__(
        self, upstream: str, gate: Gate, engines: EngineView, router_model: str, drain: Drain
    ) -> None:
        self.upstream, self.gate, self.engines, self.router_model = upstream, gate, engines, router_model
        self.drain = drain
        self.channel: aio.Channel | None = None
        self.session = None  # aiohttp's, for the engines' gauges

    def service(self, details: grpc.HandlerCallDetails):
        if not details.method.startswith(SERVICE):
            return None
        name = details.method[len(SERVICE) :]
        if name == "ModelStreamInfer":
            return grpc.stream_stream_rpc_method_handler(self._stream(details.method))
        return grpc.unary_unary_rpc_method_handler(self._unary(name, details.method))

    async def _admit(self, name: str, context) -> tuple[tuple[str, str], ...]:
        """The metadata tritonserver gets; a call refused here is aborted (raises)."""
        if self.drain.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, MESSAGE)
        metadata = context.invocation_metadata() or ()
        key = _key(metadata)
        if (refusal := self.gate.refusal(name, key)) is not None:
            await context.abort(*refusal)
        sent = tuple((k, v) for k, v in metadata if k in FORWARDED)
        upstream = self.gate.upstream_key(key)
        return sent + ((GRPC_HEADER, f"Bearer {upstream}"),) if upstream else sent

    async def _admit_tenant(self, name: str, context) -> Tenant | None:
        """An inference call's tenant, now with one more request in flight (None: not an
        inference call); refused, the call is aborted (raises)."""
        if name not in INFERENCE:
            return None
        metadata = context.invocation_metadata() or ()
        try:
            tenant = self.gate.tenants.tenant(_key(metadata), dict(metadata).get(TENANT_HEADER))
            self.gate.tenants.admit(tenant)
        except TenantRefused as exc:
            await context.abort(REFUSED[exc.status], str(exc))
        return tenant

    @contextmanager
    def _open(self, call):
        """``call`` counts as open for the drain, which may cut it, until it ends."""
        self.drain.open += 1
        self.drain.upstreams.add(call)
        try:
            yield call
        finally:
            self.drain.open -= 1
            self.drain.upstreams.discard(call)

    def _unary(self, name: str, method: str):
        async def relay(request: bytes, context) -> bytes:
            metadata = await self._admit(name, context)
            tenant = await self._admit_tenant(name, context)
            try:
                return await self._relay_unary(name, method, request, metadata, tenant, context)
            finally:
                if tenant is not None:
                    self.gate.tenants.release(tenant)

        return relay

    async def _relay_unary(self, name: str, method: str, request: bytes, metadata, tenant: Tenant | None,
                           context) -> bytes:  # fmt: skip
        if tenant is not None:
            request = with_tenant(request, tenant)
        call = self.channel.unary_unary(method)(request, metadata=metadata, timeout=context.time_remaining())
        with self._open(call):
            try:
                answer = await call
            except aio.AioRpcError as exc:
                await context.abort(*_status(exc))
            except asyncio.CancelledError:
                if not self.drain.cut_this_task():
                    raise
                await context.abort(grpc.StatusCode.UNAVAILABLE, MESSAGE)
        if name in ("ServerReady", "ModelReady") and await self._not_serving(name, request):
            return _not_ready(name)
        return answer

    def _stream(self, method: str):
        async def relay(requests: AsyncIterator[bytes], context) -> AsyncIterator[bytes]:
            metadata = await self._admit("ModelStreamInfer", context)
            tenant = await self._admit_tenant("ModelStreamInfer", context)
            try:
                async for answer in self._relay_stream(method, requests, metadata, tenant, context):
                    yield answer
            finally:
                self.gate.tenants.release(tenant)

        return relay

    async def _relay_stream(self, method: str, requests: AsyncIterator[bytes], metadata, tenant: Tenant,
                            context) -> AsyncIterator[bytes]:  # fmt: skip
        async def rewritten():
            async for request in requests:
                yield with_tenant(request, tenant)

        call = self.channel.stream_stream(method)(rewritten(), metadata=metadata,
                                                  timeout=context.time_remaining())  # fmt: skip
        started = False
        with self._open(call):
            try:
                async for answer in call:
                    started = True
                    yield answer
            except aio.AioRpcError as exc:
                code, message = _status(exc)
                lost = exc.code() == grpc.StatusCode.UNAVAILABLE and not retryable(exc.details() or "")
                if started and lost:
                    message = f"{LOST} ({exc.details()}); the answer is incomplete"
                await context.abort(code, MESSAGE if self.drain.cutting else message)
            except asyncio.CancelledError:
                if not self.drain.cut_this_task():
                    raise
                await context.abort(grpc.StatusCode.UNAVAILABLE, MESSAGE)
            finally:
                call.cancel()  # a client that left: tritonserver's stream is cancelled, and the request

    async def _not_serving(self, name: str, request: bytes) -> bool:
        """Whether a probe tritonserver called ready is of the router with no engine up."""
        from tritonclient.grpc import service_pb2

        if (
            name == "ModelReady"
            and service_pb2.ModelReadyRequest.FromString(request).name != self.router_model
        ):
            return False
        up, _why = await self.engines.serving(self.session)
        return not up


def with_tenant(request: bytes, tenant: Tenant) -> bytes:
    """An inference request with ``tenant``'s parameters written over its own."""
    from google.protobuf.message import DecodeError
    from tritonclient.grpc import service_pb2

    try:
        message = service_pb2.ModelInferRequest.FromString(request)
    except DecodeError:  # tritonserver refuses it as it refuses any bytes it cannot parse
        return request
    for name, value in tenant.parameters().items():
        message.parameters[name].string_param = value
    return message.SerializeToString()


def _not_ready(name: str) -> bytes:
    from tritonclient.grpc import service_pb2

    kind = service_pb2.ServerReadyResponse if name == "ServerReady" else service_pb2.ModelReadyResponse
    return kind(ready=False).SerializeToString()


def _status(exc: aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    """tritonserver's error as the status a client should act on."""
    message = exc.details() or ""
    if rate_limited(message):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, message
    if exc.code() == grpc.StatusCode.UNAVAILABLE and "protocol is restricted" in message:
        return grpc.StatusCode.PERMISSION_DENIED, message  # a key the front let through; Triton refused it
    if exc.code() == grpc.StatusCode.UNAVAILABLE and not retryable(message):
        return exc.code(), f"the router's tritonserver is unreachable ({message}); retry later"
    if retryable(message):
        return grpc.StatusCode.UNAVAILABLE, message
    if invalid(message):
        return grpc.StatusCode.INVALID_ARGUMENT, message
    return exc.code(), message


async def start_grpc_front(front: GrpcFront, host: str, port: int, max_message_bytes: int) -> aio.Server:
    """Listen on ``host:port``; the upstream channel opens in the running loop."""
    import aiohttp

    front.channel = aio.insecure_channel(front.upstream, options=UNLIMITED)
    front.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
    server = aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                 ("grpc.max_send_message_length", -1)])  # fmt: skip
    server.add_generic_rpc_handlers((front,))
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server
