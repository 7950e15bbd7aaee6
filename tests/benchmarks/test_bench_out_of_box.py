import asyncio

from benchmarks.bench_learning_e2e import send
from benchmarks.bench_out_of_box import summary
from tests.helpers.vllm_stub import answer, local_backend


def test_the_summary_takes_each_round_against_its_own_fcfs():
    def row(kind, r, loads, tpf, p99):
        return {"kind": kind, "round": r, "loads_per_token": loads, "tokens_per_forward": tpf, "p99_s": p99,
                "p50_s": 1.0, "wall_s": 10.0, "failed": 0}
    rows = [row("fcfs", 0, 4.0, 14.0, 2.0), row("no-flag", 0, 3.6, 14.0, 2.0),  # 10%
            row("fcfs", 1, 5.0, 14.0, 2.0), row("no-flag", 1, 4.0, 13.72, 2.2)]  # 20%: its own round's fcfs
    line = summary("ours", rows)
    assert "+15.0% +- 5.0% fewer decode expert loads" in line and "tokens per forward -1.0%" in line
    assert "p99 +5.0%" in line and "0 requests failed" in line


def test_failed_requests_are_counted_not_raised():
    seen = []

    async def flaky(request):
        seen.append(1)
        return answer({"error": "down"}, 502) if len(seen) % 2 else answer({"choices": []})

    async def main():
        async with local_backend(flaky) as url:
            return await send(url, [f"p{i}" for i in range(6)], clients=2, max_tokens=4)
    sent = asyncio.run(main())
    assert sent["failures"] == {"502": 3} and len(sent["latencies"]) == 3
