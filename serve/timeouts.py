"""The gateway's HTTP protocol: uvicorn's h11 protocol with a header read timeout.

    uvicorn.run(app, http=header_timeout_protocol(10.0), ...)   # what `aftraj serve gateway` does

uvicorn closes a connection that stays idle between requests (`timeout_keep_alive`), but one
that sends part of its request line or headers and then nothing stays open for good (one socket
each, however many). Here a connection whose request headers are not complete `header_timeout_s`
after it opened (or after its previous response) is closed. Each connection's kernel send buffer
is capped (`SEND_BUFFER`). The body's own timeout is the ASGI middleware's
(`serve.router.BodyLimit`: 408), since the app reads the body.

Connections are counted per client address: past `max_per_address` a new connection is closed
as soon as it is accepted (past `max_total` in all: one from an address that already holds
`FAIR_SHARE`, and any past `max_total + RESERVE`), so one address holding thousands of
half-sent requests cannot take the process's open files (and starve a legitimate request). A
test or benchmark reaches the cap from other loopback addresses (127.0.0.2, …) while a
client on 127.0.0.1 is served.
"""

from __future__ import annotations

import socket

from uvicorn.protocols.http.h11_impl import H11Protocol

# Kernel send buffer per connection: on loopback it autotunes to megabytes, so a stream that
# never reads takes megabytes of verdict history through the event loop before flow control
# pauses it; with 256 KB it pauses after a few pages.
SEND_BUFFER = 256 * 1024


FAIR_SHARE = 8     # connections an address may still open once the gateway holds max_total
RESERVE = 128      # connections above max_total kept for addresses holding fewer than FAIR_SHARE


def header_timeout_protocol(header_timeout_s: float, max_per_address: int | None = None,
                            max_total: int | None = None, on_refused=None) -> type:
    """An H11Protocol subclass that closes connections whose headers are late, and connections
    past `max_per_address` of one client address or `max_total` in all (`on_refused()` is
    called for each: the gateway counts them)."""
    open_by_addr: dict[str, int] = {}
    total = [0]

    class HeaderTimeoutH11(H11Protocol):
        # differs from H11Protocol by the timer armed while no request's headers are complete,
        # and by the per-address count of open connections
        _hdr_timer = None
        _addr = None

        def _arm(self) -> None:
            self._disarm()
            self._hdr_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._hdr_timer is not None:
                self._hdr_timer.cancel()
                self._hdr_timer = None

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _headers_late(self) -> None:
            self._hdr_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            addr = peer[0] if isinstance(peer, tuple) and peer else "?"
            n = open_by_addr.get(addr, 0)
            # past max_total, an address that already holds FAIR_SHARE connections gets no more
            # (many addresses together cannot shut out one that holds few), and past
            # max_total + RESERVE nobody does (the process's open files stay below its limit)
            if (max_per_address is not None and n >= max_per_address) or (max_total is not None and (
                    total[0] >= max_total + RESERVE or (total[0] >= max_total and n >= FAIR_SHARE))):
                if on_refused is not None:
                    on_refused()
                transport.abort()            # at once: no buffered bytes, no lingering file
                return
            self._addr = addr
            open_by_addr[addr] = n + 1
            total[0] += 1
            sock = transport.get_extra_info("socket")
            if sock is not None:      # a client that stops reading holds at most this much in the kernel
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
                except OSError:
                    pass
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._waiting_for_headers():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._waiting_for_headers():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._addr is not None:
                left = open_by_addr.get(self._addr, 1) - 1
                if left > 0:
                    open_by_addr[self._addr] = left
                else:
                    open_by_addr.pop(self._addr, None)
                total[0] -= 1
                self._addr = None
            super().connection_lost(exc)

    return HeaderTimeoutH11
