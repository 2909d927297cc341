"""Python client of the gateway (sync and async), for agent frameworks and tests.

    from serve.client import GatewayClient
    with GatewayClient("http://127.0.0.1:8080", api_key=KEY) as gw:
        run = gw.create_run(task="Plan a trip", agents=["planner", "booker"])
        v = gw.post_events(run, [{"event_id": "e1", "kind": "message", "agent": "planner",
                                  "payload": {"content": "…"}}])
        if v["decision"] == "ALARM": ...
    # async: AsyncGatewayClient, same methods, awaited; `stream(run)` yields verdicts (SSE)

Retries: a batch is idempotent by event id, so `post_events` retries connection errors, 429
(honouring Retry-After up to the client's timeout; a longer one raises at once) and 5xx with
the same body; a 4xx is raised as `GatewayClientError`
with the server's `Problem` (detail, event_index, event_id, field).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson

from aftraj.llm_client import retry_after_s


class GatewayClientError(RuntimeError):
    def __init__(self, status: int, problem: dict):
        super().__init__(f"HTTP {status}: {problem.get('detail')}")
        self.status, self.problem = status, problem


def _event(e) -> dict:
    return e.to_record() if hasattr(e, "to_record") else e


def _retryable(status: int) -> bool:
    return status in (408, 429) or 500 <= status < 600


def _wait_s(resp: httpx.Response, attempt: int, timeout: float) -> float | None:
    """Seconds to wait before retrying `resp` (the server's Retry-After, else back-off); None when
    the server asks for more than the client's timeout: the error is raised at once, never slept."""
    ra = retry_after_s(resp.headers.get("retry-after"))
    if ra is not None and ra > timeout:
        return None
    return ra or min(2.0, 0.1 * 2 ** attempt)


def _raise(resp: httpx.Response) -> dict:
    if resp.status_code >= 400:
        try:
            problem = resp.json()
        except ValueError:
            problem = {"detail": resp.text[:300]}
        raise GatewayClientError(resp.status_code, problem)
    return resp.json()


class GatewayClient:
    def __init__(self, base_url: str, api_key: str, *, timeout: float = 30.0, retries: int = 3,
                 transport=None):
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, transport=transport,
                                 headers={"Authorization": f"Bearer {api_key}"})
        self.retries, self.timeout = retries, timeout

    def _req(self, method: str, path: str, body=None) -> dict:
        content = orjson.dumps(body) if body is not None else None
        headers = {"Content-Type": "application/json"} if body is not None else None
        for attempt in range(self.retries + 1):
            try:
                resp = self.http.request(method, path, content=content, headers=headers)
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
                time.sleep(min(2.0, 0.1 * 2 ** attempt))
                continue
            if _retryable(resp.status_code) and attempt < self.retries:
                wait = _wait_s(resp, attempt, self.timeout)
                if wait is not None:
                    time.sleep(wait)
                    continue
            return _raise(resp)
        raise AssertionError("unreachable")

    def create_run(self, task: str, agents=(), category: str | None = None, run_id: str | None = None) -> str:
        body = {"task": task, "agents": list(agents), "category": category, "run_id": run_id}
        return self._req("POST", "/v1/runs", body)["run_id"]

    def post_events(self, run_id: str, events) -> dict:
        return self._req("POST", f"/v1/runs/{run_id}/events", {"events": [_event(e) for e in events]})

    def run(self, run_id: str) -> dict:
        return self._req("GET", f"/v1/runs/{run_id}")

    def health(self) -> dict:
        return self._req("GET", "/healthz")

    def close(self) -> None:
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncGatewayClient:
    def __init__(self, base_url: str, api_key: str, *, timeout: float = 30.0, retries: int = 3,
                 transport=None):
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout, transport=transport,
                                      headers={"Authorization": f"Bearer {api_key}"})
        self.retries, self.timeout = retries, timeout

    async def _req(self, method: str, path: str, body=None) -> dict:
        content = orjson.dumps(body) if body is not None else None
        headers = {"Content-Type": "application/json"} if body is not None else None
        for attempt in range(self.retries + 1):
            try:
                resp = await self.http.request(method, path, content=content, headers=headers)
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(min(2.0, 0.1 * 2 ** attempt))
                continue
            if _retryable(resp.status_code) and attempt < self.retries:
                wait = _wait_s(resp, attempt, self.timeout)
                if wait is not None:
                    await asyncio.sleep(wait)
                    continue
            return _raise(resp)
        raise AssertionError("unreachable")

    async def create_run(self, task: str, agents=(), category: str | None = None, run_id: str | None = None) -> str:
        body = {"task": task, "agents": list(agents), "category": category, "run_id": run_id}
        return (await self._req("POST", "/v1/runs", body))["run_id"]

    async def post_events(self, run_id: str, events) -> dict:
        return await self._req("POST", f"/v1/runs/{run_id}/events", {"events": [_event(e) for e in events]})

    async def run(self, run_id: str) -> dict:
        return await self._req("GET", f"/v1/runs/{run_id}")

    async def stream(self, run_id: str, after_seq: int | None = None):
        """Yield each verdict the gateway streams for the run (stored ones first; with
        `after_seq`, only those after it: how a dropped stream resumes)."""
        headers = {"Last-Event-ID": str(after_seq)} if after_seq is not None else None
        async with self.http.stream("GET", f"/v1/runs/{run_id}/stream", timeout=None, headers=headers) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                _raise(resp)
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    yield orjson.loads(line[6:])

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
