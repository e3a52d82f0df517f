"""Fits of the engine-step calibration points: host overhead per op/token/step, and the in-step
streaming efficiency of the weight-streaming kernels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from epserve.planner.calibrate_engine import engine_config
from epserve.planner.hardware import HardwareSpec, MeasuredPoint

STREAM_EFFICIENCY_RANGE = (0.25, 2.0)


def fit_overhead(spec: HardwareSpec, points: Sequence[MeasuredPoint]) -> tuple[float, float, float]:
    """``(op_overhead_us, op_overhead_per_token_us, step_overhead_us)`` from ``engine_step`` points.
    The measured step less the step the planner prices without host overhead is
    ``ops x (op_overhead + tokens x per_token) + step_overhead``, the op count read off the planner
    itself (the same stage list). At each batch the slope over the depths is the overhead per op
    (the intercept, the step's, cannot leak into it); a line through those slopes against the
    tokens gives the per-op and per-token parts; the intercept at the smallest batch the step's."""
    from epserve.config import ModelConfig
    from epserve.planner.deployment import Deployment
    from epserve.planner.step import estimate_step

    bare = replace(spec, op_overhead_us=0.0, op_overhead_per_token_us=0.0, step_overhead_us=0.0)
    by_batch: dict[int, list[tuple[float, float]]] = {}
    for p in points:
        if p.kind != "engine_step":
            continue
        _, layers, _, batch, kv = p.shape.split()
        model = ModelConfig.from_dict(engine_config(int(layers)))
        d = Deployment(ep=1, batch=int(batch.removeprefix("b")), kv_len=int(kv.removeprefix("kv")),
                       overlap="dispatch", weight_dtype="bf16")
        base = estimate_step(model, bare, d, "dispatch").step_time_us
        ops = estimate_step(model, replace(bare, op_overhead_us=1.0), d, "dispatch").step_time_us - base
        by_batch.setdefault(d.batch, []).append((ops, p.time_us - base))
    lines = {b: _line(pts) for b, pts in sorted(by_batch.items()) if len({x for x, _ in pts}) > 1}
    if not lines:
        return spec.op_overhead_us, spec.op_overhead_per_token_us, spec.step_overhead_us
    first = min(lines)
    if len(lines) == 1:
        per_op, per_token = max(lines[first][0], 0.0), 0.0
    else:
        per_token, per_op = _line([(b, slope) for b, (slope, _) in lines.items()])
        per_token = max(per_token, 0.0)
        per_op = max(per_op, 0.0) if per_token else max(sum(s for s, _ in lines.values()) / len(lines), 0.0)
    slope_first = per_op + per_token * first
    step = sum(y - slope_first * x for x, y in by_batch[first]) / len(by_batch[first])
    return per_op, per_token, max(step, 0.0)


def fit_stream_efficiency(spec: HardwareSpec, points: Sequence[MeasuredPoint]) -> float:
    """``stream_efficiency`` from ``engine_stream`` points: the factor on the weight-streaming
    classes' memory fractions at which the planner's steps (priced with ``spec``'s host overheads)
    are on average exactly as long as the measured ones, i.e. the mean relative error over the
    points is zero (found by bisection: the price falls as the factor grows). Clipped to
    ``STREAM_EFFICIENCY_RANGE``; ``spec``'s own value without points."""
    from epserve.config import ModelConfig
    from epserve.planner.deployment import Deployment
    from epserve.planner.step import estimate_step

    cases = []
    for p in points:
        if p.kind != "engine_stream":
            continue
        label, layers, _, batch, kv = p.shape.split()
        model = ModelConfig.from_dict(engine_config(int(layers), int(label.removeprefix("wide"))))
        d = Deployment(ep=1, batch=int(batch.removeprefix("b")), kv_len=int(kv.removeprefix("kv")),
                       overlap="dispatch", weight_dtype="bf16")
        cases.append((model, d, p.time_us))
    if not cases:
        return spec.stream_efficiency

    def error(factor: float) -> float:
        hw = replace(spec, stream_efficiency=factor)
        return sum(estimate_step(m, hw, d, "dispatch").step_time_us / t - 1 for m, d, t in cases)

    lo, hi = STREAM_EFFICIENCY_RANGE
    if error(lo) <= 0:
        return lo
    if error(hi) >= 0:
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if error(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(slope, intercept)`` of ``y = slope x + intercept``."""
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return slope, my - slope * mx
