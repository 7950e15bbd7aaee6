import asyncio
import time

from moe_cohort.send.metrics import Metrics, watch_loop_lag


def _samples(metrics: Metrics) -> dict[str, float]:
    return {f"{s.name}{s.labels.get('le', '')}": s.value
            for f in metrics.registry.collect() if f.name == "cohort_event_loop_lag_seconds" for s in f.samples}


def test_the_loop_lag_watch_sees_a_blocked_event_loop():
    """A callback that holds the event loop for 0.3 s makes the watch's timer that long late: one sample over
    0.25 s, the others (a free loop) under 0.1 s."""
    metrics = Metrics()

    async def run() -> None:
        watch = asyncio.get_running_loop().create_task(watch_loop_lag(metrics.loop_lag, every_s=0.02))
        await asyncio.sleep(0.1)
        time.sleep(0.3)  # the loop serves nothing meanwhile
        await asyncio.sleep(0.1)
        watch.cancel()

    asyncio.run(run())
    samples = _samples(metrics)
    count = samples["cohort_event_loop_lag_seconds_count"]
    assert count >= 5
    assert samples["cohort_event_loop_lag_seconds_bucket0.25"] == count - 1  # one late by the blocked 0.3 s
    assert samples["cohort_event_loop_lag_seconds_bucket0.1"] == count - 1
