"""The replay of bench_learning_e2e's own conditions, beside what the engine measured (issue 26).

    python -m benchmarks.record_traces --model MODEL_DIR --out TRACES --max-tokens 32
    python -m benchmarks.bench_replay_vs_engine --traces TRACES [--clients 64] [--slots 16] [--orders 10]
        [--e2e E2E.json]

TRACES: the trained tiny MoE's routing of every mixed.jsonl prompt, recorded through the plugin with
the requests bench_learning_e2e sends (32 tokens, `ignore_eos`). The held-out prompts, in the e2e
run's seeded order, are replayed (eval.replay) through one engine of --slots slots, admitted by:

    fcfs          first come, first served (the e2e run's baseline)
    nearest       nearest static embedding to the resident set (no head)
    head on 800   static embedding + profile head fitted on the first 800 training prompts of the
                  e2e run's order (what the learning proxy had seen when its held-out run began)
    offline head  the same head fitted on every training prompt (the e2e run's offline head)
    reference     the requests' own decode profiles (what a perfect predictor would give)

each with --clients closed-loop clients (at most clients - slots wait, as in the e2e run) and with
every request waiting from the start (the replay of issue 25's tables). Printed per row: decode
expert loads per generated token and the saving against fcfs in the e2e run's order, then mean and
spread of that saving over --orders other seeded orders; with --e2e (bench_learning_e2e --json) the
engine's held-out rows beside them; with --heads DIR (bench_learning_e2e --keep DIR) every profile
head saved under DIR (the learning proxy's last head, the offline one) replayed the same way, so a
head the engine served can be told apart from the serving.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

from benchmarks.bench_learning_e2e import savings
from benchmarks.heldout import embeddings, prompt_texts
from moe_cohort.encoder.profile import HEAD_FILE, load_profile_head
from moe_cohort.eval.policies import Policy, by_embedding, by_profile, fixed_order
from moe_cohort.eval.replay import decode_profiles, decode_tokens
from moe_cohort.traces.format import TraceSet
from moe_cohort.traces.importers import load_traces
from moe_cohort.traces.split import split_requests
from moe_cohort.train.profile_head import fit_profile_head
from moe_cohort.train.targets import profiles


def e2e_sides(ts: TraceSet) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) trace indices in bench_learning_e2e's seeded arrival orders."""
    texts = prompt_texts()
    train_idx, held_idx = split_requests(len(texts), groups=texts)
    train, held = [texts[i] for i in train_idx], [texts[i] for i in held_idx]
    random.Random(0).shuffle(train)
    random.Random(1).shuffle(held)
    where = {str(t): i for i, t in enumerate(ts.texts)}  # a text sent twice was recorded once
    missing = [t for t in train + held if t not in where]
    if missing:
        print(f"({len(missing)} prompts not in the traces, left out)")
    side = lambda texts: np.array(list(dict.fromkeys(where[t] for t in texts if t in where)))  # noqa: E731
    return side(train), side(held)


def policies(ts: TraceSet, train: np.ndarray, held: np.ndarray, warm: int) -> dict[str, Policy]:
    """The rows of the module docstring; requests join in the held-out side's order (trace order of `held`)."""
    x = embeddings(list(ts.texts), "static")  # [N, D]
    prof = profiles(ts)  # [N, L, E] decode profiles (the traces have generated tokens)
    texts = [str(t) for t in ts.texts]

    def head(fit: np.ndarray) -> Policy:
        h = fit_profile_head(x[fit], prof[fit], ts.top_k, texts=[texts[i] for i in fit])
        return by_profile(h.predict(x[held], [texts[i] for i in held]))

    held_ts = ts.subset(held)
    return {"fcfs": fixed_order(np.arange(len(held))), "nearest": by_embedding(x[held]),
            f"head on {warm}": head(train[:warm]), "offline head": head(train),
            "reference": by_profile(decode_profiles(decode_tokens(held_ts), held_ts))}


def replay_rows(ts: TraceSet, rows: dict[str, Policy], slots: int, clients: int | None, orders: int) -> dict:
    """Loads per generated token in the e2e order, and the saving against fcfs there and over `orders` others."""
    tokens = decode_tokens(ts)
    lengths = tokens.cycle  # [n] each request's recorded decode tokens
    out = {}
    for seed in range(orders + 1):
        order = np.arange(len(ts)) if seed == 0 else np.random.default_rng(seed).permutation(len(ts))
        lpt = {name: Policy(p.routing, p.vectors, p.embedding, order=order).run(tokens, lengths, slots,
                                                                                clients=clients).loads_per_token
               for name, p in rows.items()}
        for name, v in lpt.items():
            out.setdefault(name, []).append((v, 1 - v / lpt["fcfs"]))
    return {name: {"loads_per_token": v[0][0], "saving": v[0][1], "saving_others": [s for _, s in v[1:]]}
            for name, v in out.items()}


def saved_heads(folder: str, x: np.ndarray, texts: list[str]) -> dict[str, Policy]:
    """A policy per profile head saved under `folder`, predicting from embeddings x [n, D] of `texts`."""
    return {str(path.parent.relative_to(folder)): by_profile(load_profile_head(path.parent).predict(x, texts))
            for path in sorted(Path(folder).rglob(HEAD_FILE))}


def print_rows(title: str, result: dict) -> None:
    width = max(16, *(len(name) for name in result))
    print(f"\n{title}\n{'admission':<{width}} {'loads/token':>11} {'vs fcfs':>8}   other orders (mean +- std)")
    for name, r in result.items():
        others = np.array(r["saving_others"])
        spread = f"{others.mean():+.1%} +- {others.std():.1%}" if len(others) else ""
        print(f"{name:<{width}} {r['loads_per_token']:>11.3f} {r['saving']:>+8.1%}   {spread}")


def print_engine(path: str) -> None:
    """The held-out rows of bench_learning_e2e --json, both sides, as the replay rows print (over its rounds:
    the mean loads per token and the mean +- std of the saving against each round's fcfs)."""
    data = json.loads(Path(path).read_text())
    for side, rows in data.items():
        print(f"\nthe engine, {side}-side admission ({path})")
        for name in dict.fromkeys(r["run"] for r in rows if "held-out" in r["run"]):
            mine = [r for r in rows if r["run"] == name]
            s = savings(rows, name)
            print(f"{name:<34} {np.mean([r['loads_per_token'] for r in mine]):>7.3f} {s.mean():>+8.1%}"
                  + (f" +- {s.std():.1%} over {len(s)} rounds" if len(s) > 1 else "")
                  + f"   {np.mean([r['tokens_per_forward'] for r in mine]):.2f} decode tokens per forward")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", required=True, help="record_traces --max-tokens 32 of the e2e run's model")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--warm", type=int, default=800, help="training prompts the learning proxy had seen")
    p.add_argument("--orders", type=int, default=10, help="other seeded orders for the spread")
    p.add_argument("--e2e", help="bench_learning_e2e --json output, printed beside")
    p.add_argument("--heads", help="replay every profile head saved under this folder (bench_learning_e2e --keep)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    ts = load_traces(args.traces)
    train, held = e2e_sides(ts)
    held_ts = ts.subset(held)
    print(f"{len(train)} training and {len(held)} held-out requests of {args.traces}; {ts.num_layers} layers x "
          f"{ts.num_experts} experts, top-{ts.top_k}; decode tokens per request {held_ts.num_decode_tokens.min()}.."
          f"{held_ts.num_decode_tokens.max()}; S = {args.slots}")
    rows = policies(ts, train, held, args.warm)
    if args.heads:  # as the e2e proxies served them: the static embedding and the n-grams
        rows |= saved_heads(args.heads, embeddings(list(held_ts.texts), "static"), [str(t) for t in held_ts.texts])
    out = {}
    for clients in (args.clients, None):
        key = f"{clients} closed-loop clients" if clients else "every request waiting from the start"
        out[key] = replay_rows(held_ts, rows, args.slots, clients, args.orders)
        print_rows(f"replay, {key}", out[key])
    if args.e2e:
        print_engine(args.e2e)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
