"""The gateway's errors: `GatewayError` (an HTTP status and a `Problem` body, raised by the
service, the limits and the web view, answered by serve.router) and `is_busy`, which tells a
database lock wait from any other database error (answered 503 with Retry-After)."""

from __future__ import annotations


class GatewayError(Exception):
    """An HTTP error the router turns into a `Problem` body."""

    def __init__(self, status: int, detail: str, *, event_index: int | None = None,
                 event_id: str | None = None, field: str | None = None, headers: dict | None = None):
        super().__init__(detail)
        self.status, self.detail = status, detail
        self.event_index, self.event_id, self.field = event_index, event_id, field
        self.headers = headers or {}

    def body(self) -> dict:
        return {"detail": self.detail, "event_index": self.event_index, "event_id": self.event_id,
                "field": self.field}


def is_busy(e: Exception, *, statement_timeout: bool = False) -> bool:
    """A database error that means "locked past the wait" (SQLite's busy, PostgreSQL's lock
    timeout; with `statement_timeout`, PostgreSQL's statement timeout too)."""
    msg = str(e)
    return ("locked" in msg or "lock timeout" in msg or "busy" in msg
            or (statement_timeout and "statement timeout" in msg))


__all__ = ["GatewayError", "is_busy"]
