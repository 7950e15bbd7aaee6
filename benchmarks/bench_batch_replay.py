"""The batch runner's "learned-first" schedule in the continuous-batching replay, on held-out requests only.

    python -m benchmarks.bench_batch_replay [--traces A,B] [--slots 16,32] [--samples 16,32,64] [--seeds 10]
        [--json FILE]

A batch file with no profile head: every line waits from step 0, S slots (vLLM's max_num_seqs),
continuous batching (eval.replay: every resident emits one token per step, a freed slot is refilled at
once). The learner is train.online.OnlineLearner with the default LearnConfig, fed each finished
request's (head features, observed profile) at the step it finishes, in finish order, as
benchmarks.bench_learning feeds it; after each observation it refits when its own schedule says so
(`due()`), as the runner's learning worker does. The learned-first schedule (`LearnedFirstRouter`):

1. the lines go first come, first served in a seeded random permutation of the file, S at a time;
2. as soon as n requests have finished (any of them; n defaults to the learner's first head, `first_fit`),
   the head is refitted on every observation so far unless the last refit saw them all (the runner's
   `fit_now`), every waiting and resident line's profile is predicted, and from then on every freed slot
   admits the waiting line expected to add the fewest experts to the residents (ReplicaRouter's
   "affinity" rule, eval.policies.by_profile's router), the whole remaining file its pool, ties to the
   earliest in the permutation; the residents at that moment count by their predicted profiles;
3. learning goes on: whenever the learner refits after an observation, every waiting line is predicted
   again by the new head (`ReplicaRouter.update`); a resident keeps the profile it was admitted with.

For each model (default: both trace folders of the data folder; DeepSeek-V2-Lite's prompt tokens stand in
for decode with lognormal lengths, gpt-oss-20b runs its own generated tokens and lengths, as
benchmarks.bench_learning replays them) the batch file is the held-out side of the project's split
(benchmarks.heldout), its lines in a random order of each seed. Rows, per S and seed:
- file order: first come, first served in the file's order, the baseline of every saving;
- learned-first n, for each n of --samples below the file's size;
- learned-first n, no refits: the first n of --samples with step 3 off (the head of the switch admits
  to the end), so the effect of learning on shows;
- offline head: the head fitted on the training side (HeldOut.fit_head, static encoder), admitting by the
  rule from the first line: (a) greedy admission, the whole remaining file its pool;
- plan up front: (b) the order that rule gives if requests finished in the order sent (one out, one in: the
  runner's sending_order), made once from the offline head's profiles and sent first come, first served;
- plan + admission among the next w: (c) the plan's order, the rule choosing each freed slot's line among the
  plan's next w waiting lines (closed-loop clients, S + w of them: eval.replay), for each w of --windows;
- reference: the held-out lines' own profiles, by the same rule.
Printed per model and S: the saving in decode expert loads per generated token against file order, over
all steps and over the steps with the engine kept full (eval.replay.Replay.loads_per_token and
loads_per_token_full), mean ± std over seeds, each row's share of the offline head's saving and, at
S = 16, whether each learned-first n keeps >= 85% of it (the target), and the step at which the head took
over as a share of the makespan. The JSON also has, per learned-first row, the mean number of refits after
the switch.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Callable, Hashable, NamedTuple, Protocol, Sequence

import numpy as np
from threadpoolctl import threadpool_limits

from benchmarks.bench_continuous import MODELS, held_lengths
from benchmarks.bench_learning import observation
from benchmarks.heldout import HeldOut, data_path, embeddings
from moe_cohort.admission.router import ReplicaRouter
from moe_cohort.encoder.profile import head_features
from moe_cohort.eval.engine import REFERENCE
from moe_cohort.eval.policies import by_profile, fixed_order
from moe_cohort.eval.replay import DecodeTokens, Replay, decode_tokens, replay
from moe_cohort.traces.format import TraceSet
from moe_cohort.traces.importers import load_traces
from moe_cohort.traces.observed import Observed
from moe_cohort.train.online import LearnConfig, OnlineLearner

TARGET = (16, 0.85)  # at S = 16, learned-first keeps >= 85% of the offline head's saving
FILE, OFFLINE, PLAN = "file order", "offline head", "plan up front"
METRICS = {"all": lambda r: r.loads_per_token, "full": lambda r: r.loads_per_token_full}
Embed = Callable[[list[str]], np.ndarray]  # texts -> [N, D]


class Learner(Protocol):
    """What the schedule asks of the learner, over the batch file's lines (keys 0..N-1)."""

    def observe(self, key: int) -> None: ...  # line `key` finished: learn from its observation
    def due(self) -> bool: ...  # whether a refit is due (the learner's own schedule)
    def refit(self) -> None: ...  # fit a new head on what was observed
    def predict(self) -> np.ndarray: ...  # [N, P] every line's profile by the current head


class Run(NamedTuple):
    replay: Replay
    switched: float | None  # the step at which the head took over (None: a row without a switch)
    refits: int = 0  # refits after the switch


class LearnedFirstRouter(ReplicaRouter):
    """Affinity routing that admits first come, first served (no vectors) until `n` keys have been released,
    then has the learner's head (refitted unless it saw them all) predict every key's profile and fits from
    then on: waiting keys get theirs (`update`), residents are counted by theirs (`assign`). Every released key
    is observed; a refit the learner says is due after an observation re-predicts the waiting keys (after the
    switch, with `refits`; without, the learner stops at the switch). Keys are 0..N-1, as eval.replay adds them."""

    def __init__(self, slots: Sequence[int], n: int, learner: Learner, refits: bool = True, **kwargs):
        super().__init__(slots, "affinity", **kwargs)
        self.n, self.learner, self.refits = n, learner, refits
        self.finished = 0  # keys released so far
        self.unfitted = 0  # observations since the learner's last refit
        self.switched_at: float | None = None  # the step at which the head took over
        self.refits_after = 0  # refits after the switch

    def release(self, key: Hashable) -> int:
        replica = super().release(key)
        self.finished += 1
        if self.switched_at is None or self.refits:
            self.learner.observe(int(key))
            self.unfitted += 1
            if self.learner.due():
                self._refit()
                if self.switched_at is not None:
                    self.refits_after += 1
                    vectors = self.learner.predict()  # [N, P]
                    for waiting in list(self.pool.rows):
                        self.update(waiting, vectors[waiting])
        return replica

    def admit(self, now: float) -> list[tuple[Hashable, int]]:
        if self.switched_at is None and self.finished >= self.n:
            self.switch(now)
        return super().admit(now)

    def switch(self, now: float) -> None:
        if self.unfitted:  # the runner's fit_now: refit unless the last refit saw every observation
            self._refit()
        vectors = self.learner.predict()  # [N, P]
        for key in list(self.pool.rows):
            self.update(key, vectors[key])
        for key in list(self.placed):
            self.assign(key, vectors[key])
        self.switched_at = now

    def _refit(self) -> None:
        self.learner.refit()
        self.unfitted = 0


def learned_first(tokens: DecodeTokens, lengths: np.ndarray, slots: int, permutation: np.ndarray, n: int,
                  learner: Learner, refits: bool = True) -> Run:
    """One replay of the schedule: lines in `permutation` [N], the head from the n-th finished request on,
    `learner` fresh; refits after the switch re-predict the waiting lines unless `refits` is False."""
    router = LearnedFirstRouter([slots], n, learner, refits)
    result = replay(tokens, lengths, router, order=permutation)
    switched = router.switched_at if router.switched_at is not None else result.makespan
    return Run(result, float(switched), router.refits_after)


class LineLearner:
    """An OnlineLearner (default LearnConfig) over a batch file's lines: line k's head features `features[k]`
    [F] and observation `observed[k]`."""

    def __init__(self, features: np.ndarray, observed: Sequence[Observed], config: LearnConfig = LearnConfig()):
        self.features, self.observed = features, observed
        self.learner = OnlineLearner(config)

    def observe(self, key: int) -> None:
        self.learner.observe(self.features[[key]], [self.observed[key]])

    def due(self) -> bool:
        return self.learner.due()

    def refit(self) -> None:
        self.learner.refit()

    def predict(self) -> np.ndarray:  # [N, L*E]
        return self.learner.head.from_features(self.features)


def seed_orders(m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The file's order of this seed [m] and the runner's random permutation of that file [m]."""
    file = np.random.default_rng(seed).permutation(m)
    return file, file[np.random.default_rng([seed, 1]).permutation(m)]


def no_refits(n: int) -> str:
    return f"learned-first {n}, no refits"


def replay_seed(tokens: DecodeTokens, lengths: np.ndarray, slots: int, seed: int, samples: list[int],
                fixed: dict[str, np.ndarray], learner: Callable[[], Learner], windows: Sequence[int] = ()
                ) -> dict[str, Run]:
    """Every row's replay at one seed (`learner()`: a fresh learner per replay)."""
    file, perm = seed_orders(len(tokens), seed)
    out = {FILE: Run(fixed_order(file).run(tokens, lengths, slots), None)}
    for n in samples:
        out[f"learned-first {n}"] = learned_first(tokens, lengths, slots, perm, n, learner())
    if samples:
        out[no_refits(samples[0])] = learned_first(tokens, lengths, slots, perm, samples[0], learner(), refits=False)
    for name, profiles in fixed.items():
        out[name] = Run(replace(by_profile(profiles), order=file).run(tokens, lengths, slots), None)
    plan = planned(fixed[OFFLINE], file, slots)  # [N]
    out[PLAN] = Run(fixed_order(plan).run(tokens, lengths, slots), None)
    for w in windows:
        out[mixed(w)] = Run(replace(by_profile(fixed[OFFLINE]), order=plan).run(tokens, lengths, slots,
                                                                              clients=slots + w), None)
    return out


def mixed(window: int) -> str:
    return f"plan + admission among the next {window}"


def planned(profiles: np.ndarray, file: np.ndarray, slots: int) -> np.ndarray:
    """The order greedy admission by `profiles` [N, P] gives `file` [N] if the requests finish in the order sent:
    S out, then one finishes and the freed slot admits the next (the batch runner's sending_order)."""
    policy = by_profile(profiles)
    router = policy.router([slots])
    for key in file:
        router.add(int(key), policy.vectors[key], 0.0)
    out, plan = [], []
    while len(plan) < len(file):
        admitted = [key for key, _ in router.admit(0.0)]
        out += admitted
        plan += admitted
        if out:
            router.release(out.pop(0))
    return np.asarray(plan, np.int64)


def summarise(runs: list[dict[str, Run]]) -> dict[str, dict]:
    """Per row: saving against file order per seed, mean and std, for each metric; the mean switch share and
    refits after it."""
    rows = {}
    for name in runs[0]:
        row = {}
        for metric, f in METRICS.items():
            saving = np.array([1.0 - f(r[name].replay) / f(r[FILE].replay) for r in runs])  # [seeds]
            row[metric] = {"saving": float(saving.mean()), "std": float(saving.std()), "per_seed": saving.tolist()}
        if runs[0][name].switched is not None:
            row["switch_share"] = float(np.mean([r[name].switched / r[name].replay.makespan for r in runs]))
            row["refits_after_switch"] = float(np.mean([r[name].refits for r in runs]))
        rows[name] = row
    for row in rows.values():
        row["of_offline"] = {m: row[m]["saving"] / rows[OFFLINE][m]["saving"] if rows[OFFLINE][m]["saving"] else
                             float("nan") for m in METRICS}
    return rows


def measure_slots(tokens: DecodeTokens, lengths, slots: int, seeds: int, samples: list[int],
                  fixed: dict[str, np.ndarray], learner: Callable[[], Learner], report=print,
                  windows: Sequence[int] = ()) -> dict:
    """One S: every row over `seeds` seeds, printed as a table; the target's verdict per sample size at S = 16."""
    with threadpool_limits(limits=1, user_api="blas"):
        rows = summarise([replay_seed(tokens, lengths(seed), slots, seed, samples, fixed, learner, windows)
                          for seed in range(seeds)])
    width = max(len(name) for name in rows)
    report(f"S = {slots} ({seeds} seeds): saving in decode loads per generated token against file order")
    report(f"  {'':>{width}}  {'all steps':>16}  {'kept full':>16}  {'of offline, all / full':>22}  head took over")
    for name, row in rows.items():
        share = f"{row['of_offline']['all']:>10.0%} / {row['of_offline']['full']:<9.0%}" if name != FILE else ""
        switch = f"at {row['switch_share']:.0%} of the makespan" if "switch_share" in row else ""
        cells = "  ".join(f"{row[m]['saving']:>+7.2%} ± {row[m]['std']:<6.2%}" for m in METRICS)
        report(f"  {name:>{width}}  {cells}  {share:>22}  {switch}".rstrip())
    out = {"slots": slots, "seeds": seeds, "rows": rows}
    if slots == TARGET[0]:
        out["target"] = target(rows, samples, report)
    return out


def target(rows: dict, samples: list[int], report=print) -> dict:
    """Per sample size: whether learned-first keeps >= TARGET of the offline head's saving (each metric)."""
    goal, verdicts = TARGET[1], {}
    for n in samples:
        share = rows[f"learned-first {n}"]["of_offline"]
        verdicts[n] = {m: bool(share[m] >= goal) for m in METRICS}
        report(f"  target: learned-first {n} keeps >= {goal:.0%} of the offline head's saving at S = {TARGET[0]}: "
               + ", ".join(f"{'all steps' if m == 'all' else 'kept full'} {share[m]:.0%} "
                           f"{'met' if verdicts[n][m] else 'NOT met'}" for m in METRICS))
    return verdicts


def measure_model(ts: TraceSet, slots: list[int], samples: list[int], seeds: int, embed: Embed, report=print,
                  windows: Sequence[int] = ()) -> dict:
    """One trace set's held-out side as the batch file: every S's rows (`measure_slots`)."""
    data = HeldOut.of(ts)
    texts = [str(t) for t in ts.texts]
    x = embed(texts)  # [N, D]
    f = head_features(x, texts, LearnConfig().ngram_dim)[data.held_idx]  # [m, F]
    offline = data.fit_head(x)
    fixed = {OFFLINE: offline.from_features(f), REFERENCE: data.reference}  # [m, L*E], [m, L, E]
    observed = [observation(ts, i) for i in data.held_idx]
    tokens = decode_tokens(data.held)
    lengths = held_lengths(data.held, tokens.mode)
    m = len(data.held_idx)
    kept = [n for n in samples if n < m]
    report(f"batch file: the {m} held-out requests of {len(ts)}, {tokens.mode} decode tokens "
           f"({'their own lengths' if tokens.mode == 'real' else 'lognormal lengths, mean 64'}); "
           f"learned-first n {kept}"
           + (f" (skipped, not below the file's size: {[n for n in samples if n >= m]})" if len(kept) < len(samples)
              else "") + f"; offline head alpha {offline.alpha:g}")
    return {"heldout": m, "decode_mode": tokens.mode, "samples": kept,
            "by_slots": [measure_slots(tokens, lengths, s, seeds, kept, fixed, lambda: LineLearner(f, observed), report,
                                       windows) for s in slots]}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", help=f"trace folders, comma-separated (default: {', '.join(MODELS)} of the data folder)")
    p.add_argument("--slots", default="16,32")
    p.add_argument("--samples", default=f"{LearnConfig().first_fit},32,64",
                   help="learned-first's n (>= 2): the head takes over once n requests have finished")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--windows", default="4,16", help="(c)'s w: admission among the plan's next w waiting lines")
    p.add_argument("--cache", default="/tmp/cohort-bench-cache", help="embedding cache folder (outside the repository)")
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args()
    samples = _ints(args.samples)
    if min(samples, default=0) < 2:
        p.error("every sample size must be >= 2 (a head needs observations to fit)")
    out = {}
    for path in (args.traces.split(",") if args.traces else [str(data_path(m)) for m in MODELS]):
        print(f"\n===== {path} =====", flush=True)
        out[path] = measure_model(load_traces(path), _ints(args.slots), samples, args.seeds,
                                  lambda texts: embeddings(texts, "static", args.cache), windows=_ints(args.windows))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
