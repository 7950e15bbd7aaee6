"""Local search by pairwise swaps that raise within-batch similarity.

Objective (to maximise): the sum, over batches, of the cosine similarity of every pair of members,
sum_b sum_{i<j in b} S_ij. With unit vectors this is (sum_b |c_b|^2 - N) / 2, c_b the sum of batch
b's vectors: size-constrained k-means. A swap of request i (batch a) with request j (batch b)
keeps every size and changes the objective by

    gain(i, j) = D[i, b] + D[j, a] - 2 S_ij,    D[i, b] = M[i, b] - M[i, a] + S_ii,

where M[i, b] = sum_{k in b} S_ik (D[i, b]: what i gains by moving to b, ignoring j).

Search by rounds. Each round bounds the best swap of every pair of batches from above,
    gain(i, j) <= max_{i in a} D[i, b] + max_{j in b} D[j, a] - 2 min S,
which costs O(n * nb) instead of O(n^2), evaluates the B x B swaps of the pairs whose bound is
positive, and applies each pair's best swap in order of gain if it still gains when its turn comes.
A round with no positive bound proves a 2-swap local optimum (up to `min_gain`).

Layout: members of batch b sit in slots b*B .. b*B+B-1 of a slot order, so a batch is a slice;
the one short batch is padded with ghost slots (zero similarity, never swapped).
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)


class SwapSearch:
    """2-swap local search over batches (index arrays into sim [n, n]; all of size B but one)."""

    def __init__(self, sim: np.ndarray, batches: list[np.ndarray], batch_size: int, *, min_gain: float = 1e-4):
        B, nb = batch_size, len(batches)
        self.B, self.nb, self.min_gain = B, nb, min_gain
        self.point = np.full(nb * B, -1, dtype=np.int64)  # [n_pad] slot -> request index (-1: ghost)
        for b, members in enumerate(batches):
            self.point[b * B : b * B + len(members)] = members
        self.ghost = self.point < 0  # [n_pad]
        self.sim = _slot_matrix(sim, self.point)  # [n_pad, n_pad] in slot order
        self.s_min = min(float(sim.min()), 0.0)
        self.diag = np.diag(self.sim).astype(np.float64)  # [n_pad]
        self.MT = self.sim.reshape(nb, B, nb * B).sum(axis=1).astype(np.float64)  # [nb, n_pad] M transposed
        self.own = np.empty(nb * B)  # [n_pad] M[i, own batch] - S_ii; +inf on ghosts
        self._refresh_own(range(nb))
        self.swaps, self.gained, self.rounds = 0, 0.0, 0

    def run(self, max_rounds: int) -> list[np.ndarray]:
        """Swap until no pair of batches can gain or `max_rounds` ran; return the batches."""
        for self.rounds in range(1, max_rounds + 1):
            applied = self._round()
            log.debug("swap round %d: %d applied, %d swaps, gain %.3f", self.rounds, applied, self.swaps, self.gained)
            if applied == 0:
                break
        return [p[p >= 0] for p in self.point.reshape(self.nb, self.B)]

    def _round(self) -> int:
        """One round; returns the number of swaps applied (0: local optimum reached)."""
        pairs = self._candidate_pairs()  # [P, 2]
        if len(pairs) == 0:
            return 0
        gain, s1, s2 = self._best_swaps(pairs)  # [P] each
        applied = 0
        for p in np.argsort(-gain, kind="stable"):
            if gain[p] > self.min_gain:
                applied += self._try_swap(int(s1[p]), int(s2[p]))
        return applied

    def _candidate_pairs(self) -> np.ndarray:
        """Batch pairs (a, b), a < b, whose upper bound on the best swap gain is positive."""
        D = self.MT - self.own[None, :]  # [nb, n_pad] D[b, i]: i moves to batch b
        best_in = D.reshape(self.nb, self.nb, self.B).max(axis=2)  # [nb(b), nb(a)] best member of a moving to b
        bound = best_in + best_in.T - 2.0 * self.s_min  # [nb, nb]
        a, b = np.nonzero(np.triu(bound > self.min_gain, k=1))
        return np.stack([a, b], axis=1)

    def _best_swaps(self, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Best swap of every candidate pair: (gain [P], slot in a [P], slot in b [P])."""
        B, k = self.B, np.arange(self.B)
        sa, sb = pairs[:, :1] * B + k, pairs[:, 1:] * B + k  # [P, B] slots of a and of b
        d_ab = self.MT[pairs[:, 1:2], sa] - self.own[sa]  # [P, B] members of a moving to b
        d_ba = self.MT[pairs[:, 0:1], sb] - self.own[sb]  # [P, B] members of b moving to a
        gain = d_ab[:, :, None] + d_ba[:, None, :] - 2.0 * self.sim[sa[:, :, None], sb[:, None, :]]  # [P, B, B]
        gain = gain.reshape(len(pairs), B * B)  # [P, B*B]
        flat = gain.argmax(axis=1)  # [P]
        p, (i, j) = np.arange(len(pairs)), np.divmod(flat, B)
        return gain[p, flat], sa[p, i], sb[p, j]

    def _try_swap(self, s1: int, s2: int) -> int:
        """Swap the requests in slots s1 and s2 if that still gains; returns 1 if swapped."""
        a, b = s1 // self.B, s2 // self.B
        gain = (self.MT[b, s1] - self.own[s1]) + (self.MT[a, s2] - self.own[s2]) - 2.0 * float(self.sim[s1, s2])
        if not gain > self.min_gain:  # also rejects ghosts (own = +inf)
            return 0
        delta = self.sim[s2].astype(np.float64) - self.sim[s1]  # [n_pad] a gains s2's row, loses s1's
        self.MT[a] += delta
        self.MT[b] -= delta
        for arr in (self.sim, self.MT):
            arr[:, [s1, s2]] = arr[:, [s2, s1]]
        self.sim[[s1, s2]] = self.sim[[s2, s1]]
        for arr in (self.point, self.diag):
            arr[[s1, s2]] = arr[[s2, s1]]
        self._refresh_own((a, b))
        self.swaps += 1
        self.gained += gain
        return 1

    def _refresh_own(self, batches) -> None:
        for b in batches:
            s = slice(b * self.B, (b + 1) * self.B)
            self.own[s] = np.where(self.ghost[s], np.inf, self.MT[b, s] - self.diag[s])


def _slot_matrix(sim: np.ndarray, point: np.ndarray) -> np.ndarray:
    """sim [n, n] permuted into slot order [n_pad, n_pad], zero on ghost slots (point -1)."""
    padded = np.zeros((len(sim) + 1, len(sim) + 1), dtype=np.float32)  # row/column n: the ghost
    padded[:-1, :-1] = sim
    return padded[point][:, point]  # point -1 picks the last (zero) row and column


def within_similarity(sim: np.ndarray, batches: list[np.ndarray]) -> float:
    """The objective: sum over batches of the similarity of every pair of members."""
    return float(sum((sim[np.ix_(b, b)].sum(dtype=np.float64) - np.trace(sim[np.ix_(b, b)])) / 2 for b in batches))
