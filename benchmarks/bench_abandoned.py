"""End to end through vLLM CPU: clients that leave take their requests with them.

    python -m benchmarks.bench_abandoned [--trials 10] [--clients 32] [--max-tokens 400] [--leave-after 0.5]
        [--engine ours|vllm]

The trained tiny MoE on vLLM CPU (the plugin and our scheduler, or with `--engine vllm` vLLM's own, whose slots the
proxies then admit to; max_num_seqs 16, eager), placed as the embedded
`cohort serve` places it: vLLM on all cores but one, the proxies and the clients on that one (--shared: anywhere). Per
trial, through each path of --paths in turn (vLLM called directly; a bare `cohort serve --backend URL`, which learns
from the engine's counts; the same with `--no-learn`; a first come, first served one, `--encoder none`): --clients
non-streaming completions of --max-tokens tokens each (`ignore_eos`) sent at once, each on a raw socket that its
client closes --leave-after seconds later without reading an answer (what a client timeout does). vLLM's own
counters are read every POLL_S from the moment the last client left.

Per path: the tokens vLLM generated in the 3 s after the last client left (vllm:generation_tokens_total), the
seconds until it ran nothing, the trials under --under tokens (the target: every one), and through a proxy the
worst lag of its event loop during the trial (cohort_event_loop_lag_seconds: the largest bucket bound passed). The
proxies' logs (their access lines: a 499 per client that left, with the time the proxy took to see it) stay in
the folder printed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.bench_out_of_box import SCHEDULER
from benchmarks.bench_proxy import start_proxy
from moe_cohort.embedded.backend import default_model_dir, ensure_trained_model
from moe_cohort.send.engine_counters import metric_sum

POLL_S, AFTER_S = 0.1, 3.0
DIRECT = "vLLM direct"
PATHS = {"bare proxy": [], "no learning": ["--no-learn"], "FCFS proxy": ["--encoder", "none"]}


async def read_engine(session: aiohttp.ClientSession, vllm: str) -> tuple[float, float]:
    """(tokens generated so far, requests running or waiting) from vLLM's /metrics."""
    async with session.get(vllm + "/metrics") as response:
        text = await response.text()
    busy = metric_sum(text, "vllm:num_requests_running") + metric_sum(text, "vllm:num_requests_waiting")
    return metric_sum(text, "vllm:generation_tokens_total"), busy


async def loop_lag(session: aiohttp.ClientSession, proxy: str) -> dict[float, float]:
    """The proxy's event-loop lag histogram (cohort_event_loop_lag_seconds): samples at or under each bound."""
    async with session.get(proxy + "/metrics") as response:
        text = await response.text()
    return {float(s.labels["le"]): s.value for f in text_string_to_metric_families(text)
            if f.name == "cohort_event_loop_lag_seconds" for s in f.samples if s.name.endswith("_bucket")}


def worst_lag(before: dict[float, float], after: dict[float, float]) -> float:
    """The largest bound that a lag sampled between two readings passed (0 when none passed the first)."""
    new = {bound: after[bound] - before.get(bound, 0) for bound in after}  # samples at or under each bound
    return max((bound for bound, n in new.items() if n < new[float("inf")]), default=0.0)


async def send_then_leave(url: str, body: bytes, leave_after_s: float) -> None:
    """One client: POST the completion on a socket of its own and close it `leave_after_s` later, unanswered."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    await asyncio.sleep(leave_after_s)
    writer.close()
    await writer.wait_closed()


async def idle(session: aiohttp.ClientSession, vllm: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await read_engine(session, vllm))[1] > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM is still busy from an earlier trial")
        await asyncio.sleep(POLL_S)


async def trial(url: str, vllm: str, args) -> dict:
    """One trial through `url`: the tokens generated in AFTER_S after the last client left, and when vLLM went idle."""
    body = json.dumps({"model": "tiny", "prompt": "count to a thousand", "max_tokens": args.max_tokens,
                       "ignore_eos": True}).encode()
    async with aiohttp.ClientSession() as session:
        await idle(session, vllm)
        lag = await loop_lag(session, url) if url != vllm else {}
        await asyncio.gather(*(send_then_leave(url, body, args.leave_after) for _ in range(args.clients)))
        left = time.monotonic()
        at_leave, _ = await read_engine(session, vllm)
        generated, idle_after = 0.0, None
        while (now := time.monotonic()) - left < AFTER_S:
            tokens, busy = await read_engine(session, vllm)
            generated = tokens - at_leave
            if busy == 0 and idle_after is None:
                idle_after = now - left
            await asyncio.sleep(POLL_S)
        lag_s = worst_lag(lag, await loop_lag(session, url)) if url != vllm else None
    return {"generated": generated, "idle_after_s": idle_after, "loop_lag_s": lag_s}


def report(name: str, rows: list[dict], under: int) -> str:
    generated = [r["generated"] for r in rows]
    idle = [r["idle_after_s"] for r in rows]
    shown = ", ".join(f"{g:.0f}" for g in generated)
    idles = ", ".join("never" if s is None else f"{s:.1f}" for s in idle)
    ok = sum(g < under for g in generated)
    lags = "" if rows[0]["loop_lag_s"] is None else "; the proxy's event loop late by over (s): " + ", ".join(
        f"{r['loop_lag_s']:g}" for r in rows)
    return (f"{name:>11}: {ok}/{len(rows)} trials under {under} tokens; generated after leaving: {shown}; "
            f"idle after (s): {idles}{lags}")


def trials(vllm: str, args) -> dict[str, list[dict]]:
    """--trials rounds, each path in turn: vLLM direct and the proxies of PATHS in front of `vllm`."""
    data = Path(tempfile.mkdtemp(prefix="bench-abandoned-"))
    proxies = {name: start_proxy(vllm, *PATHS[name], "--data-dir", str(data / str(i)), log=data / f"{i}.log")
               for i, name in enumerate(args.paths) if name in PATHS}
    urls = {**({DIRECT: vllm} if DIRECT in args.paths else {}), **{name: url for name, (_, url) in proxies.items()}}
    rows: dict[str, list[dict]] = {name: [] for name in urls}
    try:
        for t in range(args.trials):
            for name, url in urls.items():
                rows[name].append(asyncio.run(trial(url, vllm, args)))
            print(f"trial {t + 1}: " + "; ".join(f"{n} {r[-1]['generated']:.0f}" for n, r in rows.items()), flush=True)
    finally:
        for proc, _ in proxies.values():
            proc.terminate()
            proc.wait(30)
    print(f"proxy logs: {data}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--leave-after", type=float, default=0.5, help="seconds each client waits before it hangs up")
    p.add_argument("--under", type=int, default=200, help="the most tokens a trial may generate after they left")
    p.add_argument("--model-dir", default=str(default_model_dir()))
    p.add_argument("--paths", type=lambda s: s.split(","), default=[DIRECT, *PATHS],
                   help=f"a comma list of: {DIRECT}, {', '.join(PATHS)}")
    p.add_argument("--shared", action="store_true", help="leave vLLM, the proxies and the clients where the OS puts "
                   "them (default: as the embedded `cohort serve` places itself and vLLM, embedded/placement.py)")
    p.add_argument("--backend", help="a running vLLM server's URL (default: start the tiny MoE's)")
    p.add_argument("--engine", choices=("ours", "vllm"), default="ours", help="the started vLLM's scheduler: ours "
                   "(the engine admits), or vLLM's own (the proxies admit)")
    args = p.parse_args()
    if args.backend:
        rows = trials(args.backend, args)
    else:
        from moe_cohort.embedded.placement import move_process, split_cpus
        from moe_cohort.embedded.vllm_server import start

        model = ensure_trained_model(Path(args.model_dir))
        placement = None if args.shared else split_cpus()  # as the embedded `cohort serve` places itself
        if placement:
            move_process(placement.ours)  # the proxies and clients inherit it
        with start(model, max_num_seqs=16, max_model_len=1024, extra_args=SCHEDULER if args.engine == "ours" else (),
                   cpus=placement and placement.engine) as server:
            print(f"the proxies and clients on CPUs {sorted(os.sched_getaffinity(0))}, vLLM on "
                  f"{sorted(server.cpus or []) or 'any'}", flush=True)
            rows = trials(server.url, args)
    print(f"{args.clients} clients, {args.max_tokens} tokens each, leaving after {args.leave_after} s; tokens vLLM "
          f"generated in the {AFTER_S:.0f} s after the last one left:")
    for name, r in rows.items():
        print(report(name, r, args.under))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
