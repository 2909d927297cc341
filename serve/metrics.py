"""The gateway's counters and verdict-latency histogram, rendered in Prometheus' text format
(no client library): `GET /metrics` (serve.router) answers `Metrics.render()`.

    from serve.metrics import Metrics
    m = Metrics(); m.inc("aftraj_gateway_events_total", 3); m.observe_ms(12.5); print(m.render())
"""

from __future__ import annotations

from collections import defaultdict

LATENCY_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


class Metrics:
    """Counters and a latency histogram in Prometheus' text format (no client library)."""

    def __init__(self):
        self.counters: dict[tuple[str, tuple], float] = defaultdict(float)
        self.hist = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self.hist_sum = 0.0
        self.hist_n = 0

    def inc(self, name: str, n: float = 1, **labels) -> None:
        self.counters[(name, tuple(sorted(labels.items())))] += n

    def observe_ms(self, ms: float) -> None:
        i = next((i for i, b in enumerate(LATENCY_BUCKETS_MS) if ms <= b), len(LATENCY_BUCKETS_MS))
        self.hist[i] += 1
        self.hist_sum += ms
        self.hist_n += 1

    def render(self) -> str:
        lines = []
        names = sorted({n for n, _ in self.counters})
        for name in names:
            lines.append(f"# TYPE {name} counter")
            for (n, labels), v in sorted(self.counters.items()):
                if n == name:
                    lab = ",".join(f'{k}="{v2}"' for k, v2 in labels)
                    lines.append(f"{name}{{{lab}}} {v:g}" if lab else f"{name} {v:g}")
        lines.append("# TYPE aftraj_gateway_verdict_latency_ms histogram")
        acc = 0
        for b, c in zip(LATENCY_BUCKETS_MS, self.hist, strict=False):   # hist's last cell is +Inf (hist_n below)
            acc += c
            lines.append(f'aftraj_gateway_verdict_latency_ms_bucket{{le="{b}"}} {acc}')
        lines.append(f'aftraj_gateway_verdict_latency_ms_bucket{{le="+Inf"}} {self.hist_n}')
        lines.append(f"aftraj_gateway_verdict_latency_ms_sum {self.hist_sum:.3f}")
        lines.append(f"aftraj_gateway_verdict_latency_ms_count {self.hist_n}")
        return "\n".join(lines) + "\n"


__all__ = ["LATENCY_BUCKETS_MS", "Metrics"]
