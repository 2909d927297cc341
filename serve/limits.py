"""Who may call the gateway and how much: API keys (`KeyRing`), token buckets (`RateLimiter`),
and `Limits`, the tenant's side of every request: its key, its rate, its requests in flight,
the failed keys of a client address and the request bodies an address still has coming in.

    limits = Limits(cfg, metrics)                  # cfg: serve.config.GatewayConfig
    owner = limits.authenticate("Bearer " + key, peer="10.0.0.7")   # 401/429 as GatewayError
    limits.begin_request(owner); ...; limits.end_request(owner)     # 429 past max_inflight_per_key

Streams are counted by serve.streams (a stream is not a request in flight).
"""

from __future__ import annotations

import hmac
import math
import time
from collections import defaultdict

from serve.config import GatewayConfig, hash_key
from serve.errors import GatewayError
from serve.metrics import Metrics


class KeyRing:
    """API keys stored as sha256 hashes; `owner(header)` is the key's name or None."""

    def __init__(self, keys):
        self.keys = [(k.name, bytes.fromhex(k.sha256)) for k in keys]

    def owner(self, authorization: str | None) -> str | None:
        """The scheme is case-insensitive (RFC 9110 §11.1): `Bearer`, `bearer`, `BEARER`."""
        if not authorization or len(authorization) > 4096 or authorization[:7].lower() != "bearer ":
            return None
        digest = bytes.fromhex(hash_key(authorization[7:].strip()))
        found = None
        for name, h in self.keys:            # compare with every key: no early exit to time
            if hmac.compare_digest(h, digest):
                found = name
        return found

    def names(self) -> set[str]:
        return {n for n, _ in self.keys}


class RateLimiter:
    """A token bucket per key: `rate` requests a second, bursts up to `burst`. At most
    `max_keys` buckets are kept (the oldest forgotten first: a flood of distinct keys, such as
    client addresses, cannot grow it without bound)."""

    def __init__(self, rate: float, burst: int, max_keys: int = 100_000):
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self.tokens: dict[str, float] = {}
        self.stamp: dict[str, float] = {}

    def take(self, key: str) -> float | None:
        """None if allowed, else the seconds to wait."""
        now = time.monotonic()
        tok = min(self.burst, self.tokens.get(key, self.burst) + (now - self.stamp.get(key, now)) * self.rate)
        if key not in self.stamp and len(self.stamp) >= self.max_keys:
            old = next(iter(self.stamp))
            del self.stamp[old]
            self.tokens.pop(old, None)
        self.stamp[key] = now
        if tok >= 1:
            self.tokens[key] = tok - 1
            return None
        self.tokens[key] = tok
        return (1 - tok) / self.rate


def _retry_after(wait: float) -> dict:
    return {"Retry-After": f"{max(1, math.ceil(wait))}"}


class Limits:
    """A tenant's allowance: its key, its rate (`limits.rate_per_s`, `burst`), its requests in
    flight (`max_inflight_per_key`), the failed keys of a client address (`auth_failures_per_s`)
    and the bodies an address still has coming in (`max_pending_bodies_per_address`)."""

    def __init__(self, cfg: GatewayConfig, metrics: Metrics):
        lim = cfg.limits
        self.lim, self.metrics = lim, metrics
        self.keys = KeyRing(cfg.api_keys)
        self.limiter = RateLimiter(lim.rate_per_s, lim.burst)
        self.fail_limiter = RateLimiter(lim.auth_failures_per_s, lim.auth_failure_burst)
        self.inflight: dict[str, int] = defaultdict(int)
        self.pending_bodies: dict[str, int] = defaultdict(int)     # client address -> bodies coming in

    def authenticate(self, authorization: str | None, peer: str | None = None) -> str:
        """The key's owner; 401 for a missing or unknown key (429 once `peer`, the client's
        address, has failed more than `limits.auth_failures_per_s` allows); 429 past the key's
        rate limit."""
        owner = self.keys.owner(authorization)
        if owner is None:
            self.metrics.inc("aftraj_gateway_auth_failures_total")
            wait = self.fail_limiter.take(peer or "?")
            if wait is not None:
                self.metrics.inc("aftraj_gateway_auth_failures_limited_total")
                raise GatewayError(429, "too many requests without a valid API key from this address",
                                   headers=_retry_after(wait))
            raise GatewayError(401, "missing or unknown API key (Authorization: Bearer <key>)",
                               headers={"WWW-Authenticate": "Bearer"})
        return self.admit(owner)

    def admit(self, owner: str) -> str:
        """The key's rate limit (429 past it); returns the owner."""
        wait = self.limiter.take(owner)
        if wait is not None:
            self.metrics.inc("aftraj_gateway_rate_limited_total")
            raise GatewayError(429, f"rate limit of {self.lim.rate_per_s:g} requests/s for this key",
                               headers=_retry_after(wait))
        return owner

    def begin_request(self, owner: str) -> None:
        """Count a request in flight for `owner`; 429 past `limits.max_inflight_per_key`."""
        lim = self.lim.max_inflight_per_key
        if self.inflight[owner] >= lim:
            self.metrics.inc("aftraj_gateway_inflight_limited_total")
            raise GatewayError(429, f"over {lim} requests in flight for this key", headers={"Retry-After": "1"})
        self.inflight[owner] += 1

    def end_request(self, owner: str) -> None:
        self.inflight[owner] -= 1
        if self.inflight[owner] <= 0:
            del self.inflight[owner]

    def begin_body(self, addr: str) -> None:
        """Count a body coming in from client address `addr`; 429 past
        `limits.max_pending_bodies_per_address` (the caller closes the connection)."""
        cap = self.lim.max_pending_bodies_per_address
        if self.pending_bodies[addr] >= cap:
            self.metrics.inc("aftraj_gateway_pending_bodies_refused_total")
            raise GatewayError(429, f"over {cap} request bodies still coming in from this address",
                               headers={"Retry-After": "1", "Connection": "close"})
        self.pending_bodies[addr] += 1

    def end_body(self, addr: str) -> None:
        self.pending_bodies[addr] -= 1
        if self.pending_bodies[addr] <= 0:
            del self.pending_bodies[addr]


__all__ = ["KeyRing", "Limits", "RateLimiter"]
