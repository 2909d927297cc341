"""A misbehaving gateway on 127.0.0.1 (a free port), for the hooks' deadline tests and
benchmarks/hook_deadline.py: raw sockets, so it can do what no well-behaved server does.

    with BadGateway("drip", drip_s=1.5) as url: ...

Modes (every request, unless said):
- `drip`: a 200 with `Content-Length: 100000`, then one byte every `drip_s` seconds;
- `hang`: reads the request and never answers;
- `huge`: a 200 with no length, then `huge_mb` MB as fast as the socket takes them (`declared`:
  the same with a `Content-Length` of that size);
- `malformed`: `POST /v1/runs` answers a created run; each events post answers the next of
  `MALFORMED` in turn (JSON of the wrong shape, not JSON, a redirect, an empty 204);
- `redirect`: every request answers 302 to itself.
"""

from __future__ import annotations

import json
import socket
import threading
import time

MALFORMED = [(200, b"null"), (200, b"[]"), (200, b'"CONTINUE"'), (200, b"42"), (200, b"{"),
             (200, b'{"decision": 5}'), (200, b'{"decision": "ALARM"'), (302, b""), (204, b""),
             (200, b"\xff\xfe not utf-8")]


class BadGateway:
    def __init__(self, mode: str, *, drip_s: float = 1.5, huge_mb: int = 300):
        self.mode, self.drip_s, self.huge_mb = mode, drip_s, huge_mb
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests: list[str] = []
        self.sent_bytes = 0
        self._n_malformed = 0
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        for c in list(self._conns):
            try:
                c.close()
            except OSError:
                pass
        self.sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    @staticmethod
    def _read_request(c: socket.socket) -> tuple[str, bytes] | None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = c.recv(65536)
            if not chunk:
                return None
            buf += chunk
        head, body = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        n = 0
        for line in lines[1:]:
            if line.lower().startswith("content-length:"):
                n = int(line.split(":", 1)[1])
        while len(body) < n:
            chunk = c.recv(65536)
            if not chunk:
                return None
            body += chunk
        return lines[0], body

    def _answer(self, c, status: int, body: bytes, extra: str = "") -> None:
        reason = {200: "OK", 201: "Created", 204: "No Content", 302: "Found"}.get(status, "X")
        length = "" if status == 204 else f"Content-Length: {len(body)}\r\n"
        c.sendall(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n{length}{extra}\r\n".encode()
                  + body)

    def _serve(self, c: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                req = self._read_request(c)
                if req is None:
                    return
                line, body = req
                self.requests.append(line)
                path = line.split(" ")[1]
                if self.mode == "hang":
                    self._stop.wait()
                    return
                if self.mode == "drip":
                    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
                    while not self._stop.wait(self.drip_s):
                        c.sendall(b" ")
                        self.sent_bytes += 1
                    return
                if self.mode in ("huge", "declared"):
                    n = self.huge_mb * 1024 * 1024
                    length = f"Content-Length: {n}\r\n" if self.mode == "declared" else "Connection: close\r\n"
                    c.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{length}\r\n".encode())
                    block = b"[" + b"1," * 32767 + b"1"
                    while self.sent_bytes < n and not self._stop.is_set():
                        c.sendall(block)
                        self.sent_bytes += len(block)
                    return
                if self.mode == "redirect":
                    self._answer(c, 302, b"", f"Location: {path}\r\n")
                    continue
                if self.mode == "malformed":
                    if path == "/v1/runs":
                        rid = json.loads(body).get("run_id") or "r"
                        self._answer(c, 201, json.dumps({"run_id": rid, "event_id": "x", "seq": 0}).encode())
                        continue
                    status, out = MALFORMED[self._n_malformed % len(MALFORMED)]
                    self._n_malformed += 1
                    self._answer(c, status, out, "Location: /elsewhere\r\n" if status == 302 else "")
                    continue
                raise ValueError(f"unknown mode {self.mode!r}")
        except OSError:
            return
        finally:
            try:
                c.close()
            except OSError:
                pass


def timed(hook, attr: str = "post"):
    """Wrap `hook.<attr>` to record each call's wall time in `hook.step_s` and any exception it
    raised in `hook.raised` (the wrapper swallows nothing: it records, then re-raises)."""
    inner = getattr(hook, attr)
    hook.step_s, hook.raised = [], []

    def wrapper(*a, **kw):
        t0 = time.monotonic()
        try:
            return inner(*a, **kw)
        except BaseException as e:
            hook.raised.append(e)
            raise
        finally:
            hook.step_s.append(time.monotonic() - t0)
    setattr(hook, attr, wrapper)
    return hook
