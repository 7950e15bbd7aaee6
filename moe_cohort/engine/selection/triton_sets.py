"""Triton device functions that pick a policy slot's batch set S from the blocks' partial stats.

Part of `engine.selection.triton_kernels` (split for size; same conventions, see there): the
kind dispatch mirrors `engine.selection.table_torch.slot_sets`.
"""

import triton
import triton.language as tl

from moe_cohort.engine.selection import table as tb

NUM_STATS = 6  # stats rows per slot and block (the launcher sizes its scratch with it)
NSTAT = tl.constexpr(NUM_STATS)
AGG, WARM, VOTES, WSUM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
PROT, LOADED = tl.constexpr(4), tl.constexpr(5)
_BUDGET = tl.constexpr(tb.BUDGET)
_CONF = tl.constexpr(tb.CONF)
_DROP = tl.constexpr(tb.DROP)
_K0 = tl.constexpr(tb.K0)
_KEEP = tl.constexpr(tb.KEEP)
_KIND = tl.constexpr(tb.KIND)
_LYNX = tl.constexpr(tb.LYNX)
_M = tl.constexpr(tb.M)
_MAXP = tl.constexpr(tb.MAXP)
_MG = tl.constexpr(tb.MG)
_MOE_SPEC = tl.constexpr(tb.MOE_SPEC)
_MR = tl.constexpr(tb.MR)
_OEA_KIND = tl.constexpr(tb.OEA_KIND)
_P = tl.constexpr(tb.P)
_RANK = tl.constexpr(tb.RANK)
_RANK_STATIC = tl.constexpr(tb.RANK_STATIC)
_RANK_TOPK = tl.constexpr(tb.RANK_TOPK)
_SUBST = tl.constexpr(tb.SUBST)
_TAU = tl.constexpr(tb.TAU)
_XSHARE = tl.constexpr(tb.XSHARE)
_XSHARE_EP = tl.constexpr(tb.XSHARE_EP)
_XSHARE_SPEC = tl.constexpr(tb.XSHARE_SPEC)


@triton.jit
def _pair_rank(key, key2, cand, grp, cols):
    """[E_PAD] rank of each expert among candidates of its group by ascending (key, key2, index)."""
    a, b = key[None, :], key[:, None]
    a2, b2 = key2[None, :], key2[:, None]
    before = (a < b) | ((a == b) & ((a2 < b2) | ((a2 == b2) & (cols[None, :] < cols[:, None]))))
    before = before & cand[None, :] & (grp[None, :] == grp[:, None])
    return tl.sum(before.to(tl.int32), axis=1)


@triton.jit
def _nonempty(sel, agg, cols, ok, E_PAD: tl.constexpr):
    best_val = tl.max(tl.where(ok, agg, -1.0), axis=0)
    best = tl.min(tl.where(ok & (agg == best_val), cols, E_PAD), axis=0)
    empty = (tl.zeros_like(cols) + tl.sum(sel.to(tl.int32), axis=0)) == 0
    return sel | (empty & (cols == best))


@triton.jit
def _load_stat(part_ptr, NB, NP, p, which, cols, NB_PAD: tl.constexpr, E_PAD: tl.constexpr,
               ACC_MAX: tl.constexpr):
    """[E_PAD] one stat of slot p, reduced over the NB blocks' partials (one tile load)."""
    blocks = tl.arange(0, NB_PAD)
    tile = tl.load(part_ptr + ((blocks[:, None] * NP + p) * NSTAT + which) * E_PAD + cols[None, :],
                   mask=(blocks < NB)[:, None], other=0.0)
    if ACC_MAX:
        return tl.max(tile, axis=0)
    else:
        return tl.sum(tile, axis=0)


@triton.jit
def _fill(warm, cand, score, budget, cols, ok):
    """XShare's fill: warm plus the best-scoring fresh candidates until `budget` experts."""
    fresh = cand & ~warm & ok
    room = budget - tl.sum(warm.to(tl.float32), axis=0)
    rk = _pair_rank(-score, tl.zeros_like(score), fresh, tl.zeros_like(cols), cols)
    return warm | (fresh & (rk.to(tl.float32) < room))


@triton.jit
def _slot_set(part_ptr, NB, NP, p, E, params_ptr, static_ptr, groups_ptr, cols,
              pid_ptr, req_start_ptr, req_end_ptr, reqset_ptr, R,
              NB_PAD: tl.constexpr, R_PAD: tl.constexpr, E_PAD: tl.constexpr, NCOL: tl.constexpr):
    """[E_PAD] bool: slot p's batch set S by its kind (OEA: the experts its baselines load)."""
    ok = cols < E
    prm = params_ptr + p * NCOL
    kind = tl.load(prm + _KIND).to(tl.int32)
    agg = _load_stat(part_ptr, NB, NP, p, AGG, cols, NB_PAD, E_PAD, False)
    warm = (_load_stat(part_ptr, NB, NP, p, WARM, cols, NB_PAD, E_PAD, True) > 0) & ok
    votes = _load_stat(part_ptr, NB, NP, p, VOTES, cols, NB_PAD, E_PAD, False)
    zero = tl.zeros_like(agg)
    chosen = ok
    if kind == _XSHARE:
        chosen = _nonempty(_fill(warm, agg >= tl.load(prm + _TAU), agg, tl.load(prm + _M), cols, ok),
                           agg, cols, ok, E_PAD)
    elif kind == _XSHARE_SPEC:
        reqs = tl.arange(0, R_PAD)   # pool: the union of the request sets of this slot's requests
        starts = tl.load(req_start_ptr + reqs, mask=reqs < R, other=0)
        ends = tl.load(req_end_ptr + reqs, mask=reqs < R, other=0)
        mine = tl.load(pid_ptr + starts, mask=(reqs < R) & (ends > starts), other=-1) == p
        held = tl.load(reqset_ptr + reqs[:, None] * E_PAD + cols[None, :], mask=mine[:, None], other=0)
        pool = (tl.max(held.to(tl.int32), axis=0) > 0) & ok
        chosen = _nonempty(_fill(warm, pool, agg, tl.load(prm + _M), cols, ok), agg, cols, ok, E_PAD)
    elif kind == _XSHARE_EP:
        grp = tl.load(groups_ptr + cols, mask=ok, other=-1)
        same = grp[None, :] == grp[:, None]
        room = tl.load(prm + _MG) - tl.sum((same & warm[None, :]).to(tl.float32), axis=1)
        rk = _pair_rank(-agg, zero, ok & ~warm, grp, cols)
        chosen = _nonempty(warm | (ok & ~warm & (rk.to(tl.float32) < room)), agg, cols, ok, E_PAD)
    elif kind == _OEA_KIND:
        chosen = (_load_stat(part_ptr, NB, NP, p, LOADED, cols, NB_PAD, E_PAD, True) > 0) & ok
    elif kind == _LYNX:
        active = (votes > 0) & ok
        prot = _load_stat(part_ptr, NB, NP, p, PROT, cols, NB_PAD, E_PAD, False)
        droppable = active & ((prot == 0) | ((zero + tl.load(prm + _CONF)) < 0))
        n_active = tl.sum(active.to(tl.float32), axis=0)
        n_drop = tl.minimum(tl.load(prm + _DROP), tl.sum(droppable.to(tl.float32), axis=0))
        n_drop = tl.maximum(tl.minimum(n_drop, n_active - 1), 0.0)
        rk = _pair_rank(votes, agg, droppable, tl.zeros_like(cols), cols)
        chosen = active & ~(droppable & (rk.to(tl.float32) < n_drop))
    elif kind == _MOE_SPEC:
        used = (votes > 0) & ok
        code = tl.load(prm + _RANK)
        key = agg
        if code == _RANK_TOPK:
            key = _load_stat(part_ptr, NB, NP, p, WSUM, cols, NB_PAD, E_PAD, False)
        elif code == _RANK_STATIC:
            key = tl.load(static_ptr + p * E + cols, mask=ok, other=0.0)
        rk = _pair_rank(-key, zero, used, tl.zeros_like(cols), cols)
        chosen = used & (rk.to(tl.float32) < tl.load(prm + _BUDGET))
    return chosen
