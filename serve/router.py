"""The gateway's HTTP routes (thin: auth, limits, (de)serialisation; the logic is serve.service).

    aftraj serve gateway --config configs/serve/gateway-local.yaml
    curl -H "Authorization: Bearer $KEY" -d '{"task": "…", "agents": ["a"]}' localhost:8080/v1/runs

Routes: POST /v1/runs, POST /v1/runs/{id}/events, GET /v1/runs/{id}, GET /v1/runs/{id}/stream
(server-sent verdicts, `id:` = the verdict's seq; a reconnect with `Last-Event-ID` resumes after
it), GET /healthz, GET /metrics (Prometheus text; needs a key unless `metrics_public`),
GET /openapi.json. Every error body is a `Problem` (detail, event_index, event_id, field); no
body echoes a key. Order of checks (`BodyLimit`, in front of the routes): a declared
Content-Length over `limits.max_body_bytes` -> 413; the client address's bodies still coming in
(429 past `limits.max_pending_bodies_per_address`); then the API key and its rate limit
(401/429; 429 for an address past `limits.auth_failures_per_s` failed keys) and the key's
requests in flight (429) before any byte of the body is read (an early refusal of a request
with a body closes the connection); then the body, counted as it streams in (chunked: 413 past
the limit; 408 when it takes over `limits.body_timeout_s`; a client that leaves mid-body is
counted, nothing is answered or logged); then the body's validation (422). Connections per
client address are capped before any of this (`serve.timeouts`). `GET /v1/runs/{id}` pages its
verdicts (`verdicts_after`, `verdicts_limit`). Routes do no blocking work: bodies are parsed, validated and
answered (orjson) on the service's threads (serve.service).
"""

from __future__ import annotations

import asyncio
import time

import orjson
from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pydantic import ValidationError

from serve.protocol import EventBatch, Problem, RunCreate, RunCreated, RunView, Verdict
from serve.errors import GatewayError
from serve.service import VIEW_PAGE, GatewayService
from serve.streams import resume_after

ERRORS = {401: {"model": Problem}, 404: {"model": Problem}, 408: {"model": Problem}, 409: {"model": Problem},
          413: {"model": Problem}, 422: {"model": Problem}, 429: {"model": Problem}, 503: {"model": Problem}}


def _json_body(model) -> dict:
    """OpenAPI for a route that reads its JSON body itself (parsed on the threads)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


class BodyLimit:
    """ASGI middleware, in front of every route: 413 for a body over `limit` bytes (declared by
    Content-Length, or counted as a chunked body streams in: the body is read here, bounded, and
    handed on whole), and, for /v1/ routes, the API key and its rate limit checked BEFORE the body
    is read or validated (401/429 whatever the body holds). The key's owner is
    `scope["aftraj.owner"]`; `scope["aftraj.t0"]` is the request's arrival."""

    def __init__(self, app, limit: int, svc: GatewayService | None = None, body_timeout_s: float = 30.0):
        self.app, self.limit, self.svc, self.body_timeout_s = app, limit, svc, body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope["aftraj.t0"] = t0 = time.perf_counter()      # the request's arrival (the deadline's start)
        headers = dict(scope.get("headers", ()))
        v = headers.get(b"content-length", b"")
        if v.isdigit() and int(v) > self.limit:
            return await _send_413(send, self.limit)
        client = scope.get("client")
        addr = client[0] if client else "?"
        # a body to wait for: counted per client address while it comes in (half-sent bodies
        # held open by one address are capped; the rest of the gateway's sockets stay free)
        expects_body = (v.isdigit() and int(v) > 0) or b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        if self.svc is not None and expects_body:
            try:
                self.svc.limits.begin_body(addr)
            except GatewayError as e:
                return await _send_problem(send, e.status, e.body(), e.headers)
        held = [self.svc is not None and expects_body]

        def body_done() -> None:           # the body is in (or will never be): the address's count drops
            if held[0]:
                held[0] = False
                self.svc.limits.end_body(addr)
        try:
            await self._call(scope, receive, send, headers, t0, addr, expects_body, body_done)
        finally:
            body_done()

    async def _call(self, scope, receive, send, headers, t0, addr, counted, body_done):
        owner = None                                   # set: a request counted in flight for this key
        path = scope.get("path", "")
        if self.svc is not None and path.startswith("/v1/"):
            auth = headers.get(b"authorization")
            try:
                who = self.svc.authenticate(auth.decode("latin-1") if auth else None, addr)
                if not path.endswith("/stream"):         # a stream is counted as a stream instead
                    self.svc.begin_request(who)
                    owner = who
            except GatewayError as e:
                self.svc.metrics.inc("aftraj_gateway_http_errors_total", status=str(e.status))
                # the body is not read: close the connection rather than drain it
                return await _send_problem(send, e.status, e.body(),
                                           {**e.headers, **({"Connection": "close"} if counted else {})})
            scope["aftraj.owner"] = who
        try:
            chunks, seen = [], 0
            while True:
                left = t0 + self.body_timeout_s - time.perf_counter()
                try:
                    msg = await asyncio.wait_for(receive(), max(left, 0.001))
                except TimeoutError:
                    return await _send_problem(send, 408, {"detail": f"request body not received within "
                                                                     f"{self.body_timeout_s:g} s", "event_index": None,
                                                           "event_id": None, "field": None},
                                               {"Connection": "close"})
                if msg["type"] != "http.request":           # the client left mid-body: nothing to answer
                    if self.svc is not None:
                        self.svc.metrics.inc("aftraj_gateway_client_left_total")
                    return
                body = msg.get("body", b"")
                seen += len(body)
                if seen > self.limit:
                    return await _send_413(send, self.limit)
                chunks.append(body)
                if not msg.get("more_body"):
                    break
            body_done()
            pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

            async def replay():
                return pending.pop() if pending else await receive()

            await self.app(scope, replay, send)
        finally:
            if owner is not None:
                self.svc.end_request(owner)


async def _send_problem(send, status: int, problem: dict, headers: dict | None = None) -> None:
    body = orjson.dumps(problem)
    hs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hs += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hs})
    await send({"type": "http.response.body", "body": body})


async def _send_413(send, limit: int) -> None:
    await _send_problem(send, 413, {"detail": f"request body over the limit of {limit} bytes", "event_index": None,
                                    "event_id": None, "field": None})


def _owner(request: Request) -> str:
    """The key's owner, checked by `BodyLimit` before the body was read (the `authorization`
    parameter of each route only documents the header)."""
    return request.scope["aftraj.owner"]


def _json(obj, status: int = 200) -> Response:
    return Response(obj if isinstance(obj, bytes) else orjson.dumps(obj), status_code=status,
                    media_type="application/json")


def _problem_422(svc: GatewayService, err: dict, field: str | None, cap: int | None = None) -> JSONResponse:
    svc.metrics.inc("aftraj_gateway_http_errors_total", status="422")
    return JSONResponse({"detail": f"{field or 'body'}: {err.get('msg', 'invalid')}"[:cap], "event_index": None,
                         "event_id": None, "field": field}, status_code=422)


def _error_handlers(app: FastAPI, svc: GatewayService) -> None:
    """Every error answers a `Problem` body, counted by status."""

    @app.exception_handler(GatewayError)
    async def _gateway_error(_req: Request, e: GatewayError):
        svc.metrics.inc("aftraj_gateway_http_errors_total", status=str(e.status))
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, e: RequestValidationError):
        err = (e.errors() or [{}])[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        return _problem_422(svc, err, ".".join(loc) or None)


def _run_routes(app: FastAPI, svc: GatewayService, emit_verdict) -> None:
    """POST /v1/runs, POST /v1/runs/{id}/events, GET /v1/runs/{id}."""

    @app.post("/v1/runs", response_model=RunCreated, status_code=201, responses=ERRORS,
              openapi_extra=_json_body(RunCreate))
    async def create_run(request: Request, authorization: str | None = Header(None)):
        body = await request.body()
        try:
            req = await svc._off(RunCreate.model_validate_json, body)
        except ValidationError as e:
            err = (e.errors() or [{}])[0]
            return _problem_422(svc, err, ".".join(str(x) for x in err.get("loc", ())) or None, 1000)
        created = await svc.acreate_run(_owner(request), req)
        return _json(created.model_dump(), 201)

    @app.post("/v1/runs/{run_id}/events", response_model=Verdict, responses=ERRORS,
              openapi_extra=_json_body(EventBatch))
    async def post_events(request: Request, run_id: str, authorization: str | None = Header(None)):
        body = await request.body()
        owner = _owner(request)
        v = await svc.ingest(owner, run_id, body, t0=request.scope.get("aftraj.t0"))
        emit_verdict(v, run_id, owner, body)      # ids from (tenant, run); the batch places it on its step
        return _json(v)

    @app.get("/v1/runs/{run_id}", response_model=RunView, responses=ERRORS)
    async def get_run(request: Request, run_id: str, authorization: str | None = Header(None),
                      verdicts_after: int = Query(-1, ge=-1),
                      verdicts_limit: int = Query(VIEW_PAGE, ge=1, le=VIEW_PAGE)):
        """The run, its observer view and one page of its verdicts (seq order, after
        `verdicts_after`); `verdicts_next` is the next page's `verdicts_after` (null at the end)."""
        view = await svc.aview(_owner(request), run_id, verdicts_after, verdicts_limit)
        return _json(await svc._off(orjson.dumps, view))


def _stream_route(app: FastAPI, svc: GatewayService) -> None:
    """GET /v1/runs/{id}/stream."""

    @app.get("/v1/runs/{run_id}/stream", responses={**ERRORS, 200: {"content": {"text/event-stream": {}}}})
    async def stream(request: Request, run_id: str, authorization: str | None = Header(None),
                     last_event_id: str | None = Header(None)):
        """Server-sent events: every stored verdict of the run (after `Last-Event-ID`, a seq),
        then each new one (`event: verdict`, `id: <seq>`). At most `limits.max_streams_per_key`
        streams a key (429)."""
        items = await svc.stream_pages(_owner(request), run_id, resume_after(last_event_id))

        async def gen():
            async for page in items:
                yield b"".join(b"event: verdict\nid: %d\ndata: %b\n\n" % (seq, data)
                               for seq, data in page) or b": keep-alive\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


def _ops_routes(app: FastAPI, svc: GatewayService) -> None:
    """GET /healthz and GET /metrics."""

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "auditor": svc.cfg.auditor.backend}

    @app.get("/metrics", response_class=PlainTextResponse, responses={401: {"model": Problem},
                                                                       403: {"model": Problem}})
    async def metrics(request: Request, authorization: str | None = Header(None)):
        """Prometheus text: the counters of every tenant. Needs a key named in the config's
        `metrics_keys` (the operator's; a tenant's key gets 403) unless `metrics_public: true`."""
        if not svc.cfg.metrics_public:
            client = request.client
            who = svc.authenticate(authorization, client.host if client else None)
            if who not in svc.cfg.metrics_keys:
                svc.metrics.inc("aftraj_gateway_http_errors_total", status="403")
                raise GatewayError(403, f"key {who!r} may not read the gateway's metrics (they count every "
                                        f"tenant): the operator lists the keys that may in `metrics_keys`")
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4")


def build_app(svc: GatewayService) -> FastAPI:
    """The gateway's app: error handlers, the /v1 routes, the ops routes, the web view
    (serve.web: GET /v1/runs and /ui) and `BodyLimit` in front of them all."""
    from serve.web import register as register_web      # GET /v1/runs and the /ui pages (serve/web.py)

    app = FastAPI(title="AgentForesight gateway", version="1",
                  description="Takes a run's events, folds them, audits every prefix (DESIGN §7).")
    emit: list = []                     # AFTRAJ_EMIT's emitter, known once the web view is registered
    _error_handlers(app, svc)
    _run_routes(app, svc, lambda *a: emit[0](*a))
    _stream_route(app, svc)
    _ops_routes(app, svc)
    emit.append(register_web(app, svc))     # verdicts as OTel spans / Langfuse scores (AFTRAJ_EMIT)
    app.add_middleware(BodyLimit, limit=svc.cfg.limits.max_body_bytes, svc=svc,
                       body_timeout_s=svc.cfg.limits.body_timeout_s)
    app.state.service = svc
    return app


def openapi_json(app: FastAPI) -> str:
    """The schema as committed in serve/openapi.json (sorted keys, stable)."""
    return orjson.dumps(app.openapi(), option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2).decode() + "\n"
