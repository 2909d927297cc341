"""Server-sent verdicts: `Streams`, the hub that counts a tenant's open streams, reads a
stream's history from the store a page at a time, and fans each new verdict out to the run's
streams (`publish`, serialised once).

    q = streams.open(owner, run)                    # 429 past max_streams_per_key / max_streams
    pages = streams.pages(owner, run, q, after_seq, read_page)   # async iterator of pages

A stream that lags `STREAM_QUEUE` verdicts behind is dropped (its stream ends; the client
resumes with Last-Event-ID from the stored verdicts), never raised into the ingest that
published. At most `HISTORY_READERS` history pages are read at once over all streams.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from serve.errors import GatewayError
from serve.runs import Run
from serve.store import HISTORY_PAGE

STREAM_QUEUE = 64          # verdicts a stream may lag behind before it is dropped (it resumes from the ledger)
HISTORY_READERS = 2        # history pages read at once (all streams): the rest of the threads stay free
KEEP_ALIVE_S = 15          # an empty page (a keep-alive) after this long without a verdict


def url_int(v: str | None) -> int | None:
    """A number from a request (a page, a step, a Last-Event-ID): ASCII digits only, at most 18
    (an int64), else None (`str.isdigit` alone lets '²' through, which `int` refuses: a 500)."""
    return int(v) if v and v.isascii() and v.isdigit() and len(v) <= 18 else None


def resume_after(last_event_id: str | None) -> int:
    """The seq after which a reconnecting stream resumes (its `Last-Event-ID`); -1: from the start."""
    seq = url_int(last_event_id)
    return -1 if seq is None else seq


class Streams:
    def __init__(self, limits, metrics):
        self.lim, self.metrics = limits, metrics
        self.counts: dict[str, int] = defaultdict(int)     # owner -> open streams
        # History pages read at once, over all streams: the loop shares the GIL with every busy
        # worker thread, so many streams reading long histories at once would starve it.
        self.history_slots = asyncio.Semaphore(HISTORY_READERS)

    def open(self, owner: str, r: Run) -> asyncio.Queue:
        """Register a stream on `r`; 429 past `limits.max_streams_per_key` or `limits.max_streams`."""
        lim = self.lim
        if self.counts[owner] >= lim.max_streams_per_key or sum(self.counts.values()) >= lim.max_streams:
            self.metrics.inc("aftraj_gateway_streams_refused_total")
            raise GatewayError(429, f"too many open streams (at most {lim.max_streams_per_key} for a key, "
                                    f"{lim.max_streams} in all)", headers={"Retry-After": "5"})
        self.counts[owner] += 1
        q: asyncio.Queue = asyncio.Queue(maxsize=STREAM_QUEUE)
        r.subscribers.add(q)
        return q

    def close(self, owner: str, r: Run, q) -> None:
        r.subscribers.discard(q)
        self.counts[owner] -= 1
        if self.counts[owner] <= 0:
            del self.counts[owner]

    def publish(self, r: Run, seq: int, data: bytes) -> None:
        """Hand the verdict (serialised once) to every stream; a stalled one (queue full) is
        dropped, never raised into ingest (its events are stored, its verdict too): its stream
        ends and a reconnect (with Last-Event-ID) resumes from the stored verdicts."""
        for q in list(r.subscribers):
            try:
                q.put_nowait((seq, data))
            except asyncio.QueueFull:
                r.subscribers.discard(q)
                self.metrics.inc("aftraj_gateway_streams_dropped_total")
                q.get_nowait()                 # room for the end-of-stream mark
                q.put_nowait(None)

    async def _history(self, r: Run, last: int, read_page):
        while True:
            async with self.history_slots:   # a few streams' history at a time on the threads
                page = await read_page(r.key, last)
            if page:
                yield page
                last = page[-1][0]
            if len(page) < HISTORY_PAGE:
                break

    @staticmethod
    def _queued(q: asyncio.Queue, first) -> list:
        page = [first]
        while not q.empty():             # whatever else is queued goes in the same write
            nxt = q.get_nowait()
            if nxt is None:
                q.put_nowait(None)
                break
            page.append(nxt)
        return page

    async def pages(self, owner: str, r: Run, q: asyncio.Queue, last: int, read_page):
        """Pages of (seq, verdict JSON bytes): the stored verdicts after `last` (`read_page(key,
        after_seq)`, awaited), then each new one; an empty page is a keep-alive. Ends when the
        stream is dropped for lagging. Closes the stream (its count given back) when done."""
        try:
            async for page in self._history(r, last, read_page):
                yield page
                last = page[-1][0]
            while True:
                try:
                    item = await asyncio.wait_for(q.get(), timeout=KEEP_ALIVE_S)
                except TimeoutError:
                    yield []                     # keep-alive
                    continue
                if item is None:                 # dropped for lagging: end; a reconnect resumes
                    return
                page = [(s, d) for s, d in self._queued(q, item) if s > last]
                if page:
                    yield page
                    last = page[-1][0]
        finally:
            self.close(owner, r, q)


async def flatten(pages):
    """(seq, verdict JSON bytes) one at a time from `pages`, (None, None) for a keep-alive."""
    try:
        async for page in pages:
            if not page:
                yield None, None
            for item in page:
                yield item
    finally:
        await pages.aclose()


__all__ = ["HISTORY_READERS", "STREAM_QUEUE", "Streams", "flatten"]
