"""A worker process's expert-load metrics: one observation of two groups, and a worker's metrics written and
flushed (the tests run `write` in processes of their own)."""

from __future__ import annotations

from moe_cohort.engine.metrics import ExpertLoadMetrics


def observe_sample_forward(metrics: ExpertLoadMetrics) -> None:
    # 2 layers; groups: (decode, topk) and (decode, lynx)
    metrics.observe_forward(
        groups=[("decode", "topk"), ("decode", "lynx-lat;drop=2")], tokens=[3, 2],
        before=[[5, 4], [6, 3]], after=[[5, 2], [6, 1]], batch=("decode", "mixed"),
        batch_before=[8, 8], batch_after=[6, 7])


def write(directory: str, which: str) -> None:
    """One worker process's metrics: `observe_sample_forward` once (which="a") or a forward of its own ("b"),
    flushed."""
    metrics = ExpertLoadMetrics(directory)
    if which == "a":
        observe_sample_forward(metrics)
    else:
        metrics.observe_forward([("decode", "topk")], [4], [[7], [5]], [[7], [5]], ("decode", "topk"), [7, 5], [7, 5])
    metrics.add_time(0.25, 1.5)
    metrics.flush(force=True)
