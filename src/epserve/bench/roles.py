"""Per-role figures of a benchmark run against a prefill/decode-disaggregated deployment.

The router's ``/metrics`` is read before and after the timed run: requests each role's instances got,
KV bytes they sent and received, and the decode instances' KV transfer times (``kv_transfer_seconds``:
blocks allocated -> KV arrived, the prefill included). The client's own TTFT belongs to the prefill side
(prefill, KV transfer and the first token's delivery) and its ITL to the decode side, so the table shows
them on those rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from epserve.bench.metrics import RequestRecord, stats_ms

ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class RoleFigures:
    role: str
    instances: int
    requests: int
    kv_bytes_sent: int
    kv_bytes_received: int
    transfers: int
    transfer_mean_ms: float | None
    transfer_p50_ms: float | None  # upper bound of the histogram bucket holding the median
    transfer_p99_ms: float | None
    ttft_p50_ms: float | None = None  # the client's, on the row of the role that prefills
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None  # the client's, on the row of the role that decodes
    itl_p99_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def _bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` of cumulative ``buckets`` (None: empty)."""
    total = buckets.get(float("inf"), 0.0)
    if total <= 0:
        return None
    for bound in sorted(buckets):
        if buckets[bound] >= q * total:
            return bound
    return None


def role_figures(before: str, after: str, records: list[RequestRecord]) -> list[RoleFigures]:
    """One row per role the router's instances have; [] when the metrics say nothing of roles."""
    def by_role(text: str) -> dict[tuple[str, str, str], float]:
        out: dict[tuple[str, str, str], float] = {}
        for name, labels, value in _samples(text):
            role = labels.get("role")
            if role is None:
                continue
            extra = labels.get("direction") or labels.get("le") or ""
            key = (name, role, extra)
            out[key] = out.get(key, 0.0) + value
        return out

    old, new = by_role(before), by_role(after)
    roles = sorted({role for (name, role, _) in new if name == "epserve:engine_healthy"}, key=ROLES.index)
    ok = [r for r in records if r.success]
    _, ttft50, ttft99 = stats_ms([r.ttft for r in ok])
    _, itl50, itl99 = stats_ms([gap for r in ok for gap in r.itl])
    rows = []
    for role in roles:
        def delta(name: str, extra: str = "", role: str = role) -> float:
            return new.get((name, role, extra), 0.0) - old.get((name, role, extra), 0.0)

        count = delta("epserve:kv_transfer_seconds_count")
        buckets = {float(le): new[(n, r, le)] - old.get((n, r, le), 0.0)
                   for (n, r, le) in new if n == "epserve:kv_transfer_seconds_bucket" and r == role}
        p50, p99 = _bucket_quantile(buckets, 0.5), _bucket_quantile(buckets, 0.99)
        prefills, decodes = role in ("prefill", "both"), role in ("decode", "both")
        rows.append(RoleFigures(
            role=role,
            instances=int(new.get(("epserve:engine_healthy", role, ""), 0.0)),
            requests=int(delta("epserve:router_requests_total")),
            kv_bytes_sent=int(delta("epserve:kv_transfer_bytes_total", "sent")),
            kv_bytes_received=int(delta("epserve:kv_transfer_bytes_total", "received")),
            transfers=int(count),
            transfer_mean_ms=1e3 * delta("epserve:kv_transfer_seconds_sum") / count if count else None,
            transfer_p50_ms=None if p50 is None else 1e3 * p50,
            transfer_p99_ms=None if p99 is None else 1e3 * p99,
            ttft_p50_ms=ttft50 if prefills else None,
            ttft_p99_ms=ttft99 if prefills else None,
            itl_p50_ms=itl50 if decodes else None,
            itl_p99_ms=itl99 if decodes else None,
        ))
    return rows if any(r.role != "both" for r in rows) else []


def format_roles(rows: list[RoleFigures]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    lines = ["Per role (TTFT on the prefilling role, ITL on the decoding one; healthy instances at the end)",
             f"{'role':<8} {'inst':>4} {'requests':>8} {'KV MiB out':>10} {'KV MiB in':>9} {'transfers':>9} "
             f"{'xfer ms mean/p50/p99':>22} {'TTFT ms p50/p99':>16} {'ITL ms p50/p99':>15}"]
    for r in rows:
        xfer = f"{ms(r.transfer_mean_ms)}/{ms(r.transfer_p50_ms)}/{ms(r.transfer_p99_ms)}"
        lines.append(f"{r.role:<8} {r.instances:>4} {r.requests:>8} {r.kv_bytes_sent / 2**20:>10.2f} "
                     f"{r.kv_bytes_received / 2**20:>9.2f} {r.transfers:>9} {xfer:>22} "
                     f"{ms(r.ttft_p50_ms) + '/' + ms(r.ttft_p99_ms):>16} "
                     f"{ms(r.itl_p50_ms) + '/' + ms(r.itl_p99_ms):>15}")
    return "\n".join(lines)
