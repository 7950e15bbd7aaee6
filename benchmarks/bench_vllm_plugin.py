"""Throughput of vLLM with the moe-cohort plugin off, on with `topk`, and on with each selector.

    .venv/bin/python -m benchmarks.bench_vllm_plugin [--model DIR] [--requests 16] [--max-tokens 128]

Each session runs vLLM's offline engine (`vllm.LLM`, eager mode) in a fresh child process; "plugin
off" sessions run with `VLLM_PLUGINS=none`. A round submits `--requests` prompts at once with
`ignore_eos`, so every round is the same work: full batches of `--requests` sequences decoding
`--max-tokens` tokens each. Off and on sessions alternate (`--sessions` pairs) and the policies
take turns round by round, so drift hits every configuration alike; numbers are medians over
rounds. Per round:

- tok/s: generated tokens / wall time (noisy on a shared machine);
- plugin us/step and share: the plugin's own overhead counters, worker-thread CPU time spent in
  the plugin (`cohort_moe_plugin_cpu_seconds_total`) per step and over the CPU time of the model
  forwards (`cohort_moe_forward_cpu_seconds_total`): other jobs on the machine do not inflate them;
- distinct experts per MoE layer per decode forward (whole batch), before (router) and after
  (policy), from the plugin's `cohort_moe_batch_*` counters, read as /metrics serves them.

Target: the plugin with `topk` costs under 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POLICIES = ["topk", "xshare;m=8;k0=1", "xshare-spec;m=8;mr=6", "xshare-ep;mg=8", "oea;k0=2",
            "lynx-lat;drop=4", "lynx-acc;drop=4", "moe-spec;budget=8"]
OFF = "plugin off"


# ---- child: one engine, many rounds ---------------------------------------------------------------

SAMPLES = ("cohort_moe_batch_expert_loads_before_total", "cohort_moe_batch_expert_loads_after_total",
           "cohort_moe_batch_layer_forwards_total", "cohort_moe_plugin_cpu_seconds_total",
           "cohort_moe_forward_cpu_seconds_total")


def counters(label: str) -> list[float]:
    """The plugin's counters (SAMPLES; the batch ones for decode batches with policy `label`), read
    as /metrics would serve them, once they stop changing (the worker publishes them at most every
    100 ms and when it runs out of work)."""
    from prometheus_client import REGISTRY

    def read() -> list[float]:
        labels = {"phase": "decode", "policy": label}
        return [REGISTRY.get_sample_value(name, labels if "batch" in name else {}) or 0.0 for name in SAMPLES]

    previous, current = None, read()
    while current != previous:
        time.sleep(0.2)
        previous, current = current, read()
    return current


def child(args) -> None:
    """Run the rounds of one engine session; print one JSON line per round."""
    from vllm import LLM, SamplingParams

    from moe_cohort.engine.policy import parse_policy

    llm = LLM(model=str(args.model), dtype=args.dtype, enforce_eager=True, max_model_len=1024,
              max_num_seqs=max(16, args.requests), seed=0)
    prompts = [f"Request {i}: write a short story about the number {i * 7} and the sea." for i in range(args.requests)]
    policies = args.policies if args.plugin else [None]

    def one_round(policy: str | None) -> dict:
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0,
                                extra_args={"moe_routing": policy} if policy else None)
        label = str(parse_policy(policy or "topk"))
        c0 = counters(label) if args.plugin else [0.0] * len(SAMPLES)
        w0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - w0
        c1 = counters(label) if args.plugin else [0.0] * len(SAMPLES)
        before, after, forwards, plugin_s, forward_s = (b - a for a, b in zip(c0, c1))
        return {"config": policy or OFF, "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                "wall": wall, "loads_before": before, "loads_after": after, "forwards": forwards,
                "plugin_s": plugin_s, "forward_s": forward_s}

    for policy in policies:  # warm-up
        one_round(policy)
    for _ in range(args.repeats):
        for policy in policies:
            print(json.dumps(one_round(policy)), flush=True)


# ---- driver: sessions, table ------------------------------------------------------------------------

def run_session(args, model: Path, plugin: bool) -> list[dict]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
           "COHORT_DEFAULT_POLICY": "topk"}
    if not plugin:
        env["VLLM_PLUGINS"] = "none"
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--requests", str(args.requests),
           "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats), "--dtype", args.dtype,
           *(["--plugin", "--policies", *args.policies] if plugin else [])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if out.returncode != 0:
        raise SystemExit(f"benchmark session failed ({'on' if plugin else 'off'}):\n{out.stderr[-4000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def report(rounds: list[dict], args, model_name: str) -> None:
    by_config: dict[str, list[dict]] = {}
    for r in rounds:
        by_config.setdefault(r["config"], []).append(r)
    tps = {c: statistics.median(r["tokens"] / r["wall"] for r in rs) for c, rs in by_config.items()}
    share = {c: statistics.median(r["plugin_s"] / r["forward_s"] for r in rs) for c, rs in by_config.items()
             if c != OFF}
    print(f"{model_name}, dtype {args.dtype}; {args.requests} requests x {args.max_tokens} tokens per round, "
          f"{args.sessions} off/on session pairs x {args.repeats} rounds; medians")
    print(f"{'configuration':<26} {'tok/s':>7} {'vs off':>7} {'plugin us/step':>15} {'share':>6}   "
          f"distinct experts / layer / decode forward (router -> used)")
    for config in [OFF, *args.policies]:
        rs = by_config[config]
        before, after, fwd = (sum(r[k] for r in rs) for k in ("loads_before", "loads_after", "forwards"))
        loads_text = f"{before / fwd:5.2f} -> {after / fwd:5.2f}  ({1 - after / before:.1%} fewer)" if fwd else "n/a"
        name, vs, cost, pct = config if config == OFF else "on, " + config, "", "", ""
        if config != OFF:
            vs = f"{tps[config] / tps[OFF] - 1:+.1%}"
            steps_per_round = args.max_tokens  # one prefill + max_tokens - 1 decode forwards
            cost = f"{statistics.median(r['plugin_s'] / steps_per_round * 1e6 for r in rs):.0f}"
            pct = f"{share[config]:.1%}"
        print(f"{name:<26} {tps[config]:>7.0f} {vs:>7} {cost:>15} {pct:>6}   {loads_text}")
    if "topk" in tps:
        print(f"plugin with topk: {share['topk']:.1%} of model-forward CPU time (timed inside the worker); "
              f"throughput vs off {tps['topk'] / tps[OFF] - 1:+.1%} (wall clock). Target: overhead under 5%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model directory (default: a fresh tiny Qwen3-MoE)")
    parser.add_argument("--requests", type=int, default=16, help="prompts per round (one batch)")
    parser.add_argument("--max-tokens", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds per configuration and session")
    parser.add_argument("--sessions", type=int, default=2, help="off/on engine session pairs, alternating")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM dtype")
    parser.add_argument("--policies", nargs="*", default=POLICIES, help="policies to run with the plugin on")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plugin", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    from moe_cohort.devtools.tiny_moe import make_tiny_moe

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_tiny_moe(Path(tmp) / "tiny-moe")
        rounds = []
        for _ in range(args.sessions):
            rounds += run_session(args, model, plugin=False)
            rounds += run_session(args, model, plugin=True)
    report(rounds, args, str(args.model) if args.model else "tiny Qwen3-MoE (16 experts, top-4, 4 MoE layers)")


if __name__ == "__main__":
    main()
