"""Admission that knows the traces and looks ahead: an upper reference for the greedy rule of the replay.

The reference admission (eval.policies.by_profile with the traces' own profiles) takes, at each free
slot, the waiting request of fewest expected new experts given the residents now. `Lookahead` sees
further. At a free slot it ranks the waiting requests by that greedy rule (nobody resident: the oldest
first; else the fewest expected new experts, ties to the earliest arrival) and, for each of the first
`candidates` (K), rolls the engine forward with the true output lengths and the true decode tokens:

- the candidate takes the slot; every later free slot of the rollout is filled by the greedy rule (or,
  with `width` > 1, by the best of the first `width` greedy choices, searched recursively), first the
  other slots free at this very step (so slots that free together are chosen jointly), then the slots
  that free later;
- the rollout's window ends at the first free slot after `horizon` (H) further admissions that lies
  past the current step, or when every request has finished;
- its score is the window's decode expert loads per generated token (the distinct experts of the
  residents' true tokens per layer and step, as eval.replay counts them), over the steps with every slot
  busy when `full_only` (what `Replay.loads_per_token_full` measures), else over all of them.

The same search can plan from predictions instead: with `expected`, a rollout counts per step the
expected distinct experts of its residents' profiles (sum over layers and experts of
1 - prod_r (1 - u_r[l, e]), the quantity whose increments the greedy rule minimises) instead of their
true tokens, and with `plan_lengths` it assumes those output lengths (a resident past its planned
length is assumed to run one more step) instead of the true ones. With predicted profiles, both set,
it is a rule that sees no trace.

The candidate of the lowest score takes the slot (ties: the earlier in greedy order). K = 1 or H = 0
is the greedy rule itself. With K, H and `width` at least the number of requests the search runs
every admission order to the end, so the replay reaches the fewest loads per token (over full steps
with `full_only`) of any admission order.

It keeps the replay's rules: the router is the replay's own (admission.router.ReplicaRouter,
"affinity", one replica), which fills every free slot while a request waits (eval.replay raises if a
slot idles while requests wait); it has no fairness bound, as the reference it is compared with has
none. Only its choice of request differs (`LookaheadRouter._choose`). It needs every request known at
step 0 (no later arrivals, no closed-loop clients): a rollout assumes no request joins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moe_cohort.admission.router import ReplicaRouter
from moe_cohort.admission.resident import ResidentExperts
from moe_cohort.eval.replay import DecodeTokens, Replay, replay, span_loads


@dataclass(frozen=True)
class Lookahead:
    """A replay-compatible policy (the `run` of eval.policies.Policy): greedy candidates, scored by rollouts."""

    vectors: np.ndarray = field(repr=False)  # [N, L*E] the requests' true expert profiles
    candidates: int = 4  # K: greedy-ranked candidates scored at each free slot
    horizon: int = 4  # H: admissions after the candidate's within a rollout's window
    width: int = 1  # choices searched at each admission inside a rollout (1: greedy)
    full_only: bool = True  # score the window's steps with every slot busy only
    expected: bool = False  # rollouts count the profiles' expected loads, not the true tokens'
    plan_lengths: np.ndarray | None = field(default=None, repr=False)  # [N] lengths rollouts assume (None: true)
    shuffle: bool = True  # requests join in a random order of the run's seed, as the reference's

    def run(self, tokens: DecodeTokens, lengths: np.ndarray, slots: int, seed: int = 0,
            max_wait: float | None = None, times: np.ndarray | None = None, clients: int | None = None) -> Replay:
        """One replay of one engine of `slots` slots, every request arriving at step 0 (see the module docstring)."""
        if max_wait is not None or times is not None or clients is not None or not isinstance(slots, int):
            raise ValueError("lookahead admission replays one engine, every request at step 0, without a fairness bound")
        n = len(tokens)
        order = np.random.default_rng(seed).permutation(n) if self.shuffle else np.arange(n)
        plan = np.asarray(lengths if self.plan_lengths is None else self.plan_lengths, np.int64)
        router = LookaheadRouter(slots, tokens, plan, self.vectors, self.candidates, self.horizon, self.width,
                                 self.full_only, self.expected)
        return replay(tokens, lengths, router, vectors=self.vectors, order=order)


class LookaheadRouter(ReplicaRouter):
    """The replay's router ("affinity", one replica of `slots`) whose choice at a free slot looks ahead."""

    def __init__(self, slots: int, tokens: DecodeTokens, lengths: np.ndarray, vectors: np.ndarray,
                 candidates: int, horizon: int, width: int = 1, full_only: bool = True, expected: bool = False):
        super().__init__([slots], "affinity")
        if candidates < 1 or horizon < 0 or width < 1:
            raise ValueError(f"need candidates >= 1, horizon >= 0, width >= 1; got {candidates}, {horizon}, {width}")
        self.tokens, self.lengths = tokens, lengths
        self.profiles = np.ascontiguousarray(np.asarray(vectors, np.float32).reshape(len(lengths), -1))  # [N, L*E]
        self.neg_log = np.stack([_neg_log_idle(p) for p in self.profiles])  # [N, L*E] float64
        self.candidates, self.horizon, self.width, self.slots = candidates, horizon, width, slots
        self.full_only, self.expected = full_only, expected
        self.started: dict[int, int] = {}  # resident request -> step it was admitted
        self.joined: dict[int, int] = {}  # waiting request -> its place in arrival order

    def add(self, key, vector, now: float) -> None:
        super().add(key, vector, now)
        self.joined[int(key)] = len(self.joined)

    def release(self, key) -> int:
        self.started.pop(int(key))
        return super().release(key)

    def _choose(self, r: int, now: float):
        if self.candidates == 1 or self.horizon == 0:
            key = super()._choose(r, now)
        else:
            key = self._lookahead(int(now))
        self.started[int(key)] = int(now)
        return key

    def _lookahead(self, now: int) -> int:
        """The waiting request whose rollout loads the fewest experts per generated token."""
        waiting = np.zeros(len(self.lengths), bool)  # [N]
        waiting[[int(k) for k in self.pool.rows]] = True
        seq = np.full(len(self.lengths), np.iinfo(np.int64).max)  # [N] arrival order of the waiting ones
        for k in self.pool.rows:
            seq[int(k)] = self.joined[int(k)]
        res = np.array(sorted(self.started), np.int64)  # [R] residents
        t = now - np.array([self.started[k] for k in res], np.int64)  # [R] their decode steps so far
        state = _State(res, t, self.slots - len(res), waiting, seq)
        best, best_score = -1, np.inf
        for c in self._ranked(state, self.candidates):
            loads, toks = self._admit_and_roll(state, c, 0, 0, 0)
            score = loads / toks if toks else np.inf
            if best < 0 or score < best_score:
                best, best_score = c, score
        return best

    def _ranked(self, s: "_State", k: int) -> np.ndarray:  # [<= k] waiting requests, greedy order
        """The first `k` waiting requests in greedy order: nobody resident, by arrival; else by expected new
        experts (one [N, L*E] x [L*E] product, as admission.resident.ResidentExperts), ties by arrival."""
        idx = np.flatnonzero(s.waiting)
        if len(s.res) == 0:
            return idx[np.argsort(s.seq[idx], kind="stable")[:k]]
        idle = np.exp(-self.neg_log[s.res].sum(axis=0))  # [L*E]
        idle[idle < 1e-30] = 0.0
        cost = self.profiles[idx] @ idle.astype(np.float32)  # [n]
        if k == 1:
            best = cost.min()
            ties = cost <= best + 1e-9 * max(1.0, abs(float(best)))
            return idx[ties][np.argmin(s.seq[idx][ties])][None]
        return idx[np.lexsort((s.seq[idx], cost))[:k]]

    def _expected_loads(self, res: np.ndarray) -> float:
        """Expected distinct experts per step of residents `res`, summed over layers, if tokens pick independently."""
        return float((1.0 - np.exp(-self.neg_log[res].sum(axis=0))).sum())

    def _admit_and_roll(self, s: "_State", c: int, made: int, loads: int, toks: int) -> tuple[int, int]:
        """(loads, tokens) of the window from the root, prefix `loads`, `toks` included, after `c` takes a
        slot of state `s` (the `made`-th admission of the rollout) and the rollout runs on."""
        waiting = s.waiting.copy()
        waiting[c] = False
        s = _State(np.append(s.res, c), np.append(s.t, 0), s.free - 1, waiting, s.seq, s.moved)
        return self._roll(s, made + 1, loads, toks)

    def _roll(self, s: "_State", made: int, loads: int, toks: int) -> tuple[int, int]:
        """Advance state `s` to its next free slot and choose there, recursively, until the window ends."""
        while True:
            if s.free > 0 and s.waiting.any():
                if made > self.horizon and s.moved:
                    return loads, toks
                branches = [self._admit_and_roll(s, c, made, loads, toks) for c in self._ranked(s, self.width)]
                return min(branches, key=lambda lt: lt[0] / lt[1] if lt[1] else np.inf)
            if len(s.res) == 0:
                return loads, toks
            left = np.maximum(self.lengths[s.res] - s.t, 1)  # [R] planned steps left (>= 1: it is still running)
            span = int(left.min())
            if len(s.res) == self.slots or not self.full_only:
                loads += span * self._expected_loads(s.res) if self.expected else span_loads(self.tokens, s.res, s.t, span)
                toks += span * len(s.res)
            stay = left > span
            s = _State(s.res[stay], s.t[stay] + span, s.free + int((~stay).sum()), s.waiting, s.seq, True)


def _neg_log_idle(profile: np.ndarray) -> np.ndarray:  # [L*E] float64
    """What one resident of `profile` adds to -log P(expert idle), as admission.resident.ResidentExperts holds it."""
    one = ResidentExperts(1, len(profile))
    one.add(profile)
    return one.log_idle


@dataclass(frozen=True)
class _State:
    """A rollout's engine at a moment: residents, their decode steps so far, free slots, who waits."""

    res: np.ndarray  # [R] resident requests
    t: np.ndarray  # [R] decode steps each has run
    free: int  # free slots
    waiting: np.ndarray  # [N] bool
    seq: np.ndarray  # [N] arrival order (waiting requests)
    moved: bool = False  # the clock has passed the root's step
