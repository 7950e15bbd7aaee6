"""Triton kernels for table-driven expert selection (imported only where Triton is installed).

Same decisions as `backend.selection.table_torch.route_tables` (the reference these are tested
against; the papers are cited in the per-policy modules), as three or four launches per MoE
layer, none with a host synchronisation:

    _request_kernel  grid (R,)   XShare-spec's per-request sets (Alg. 3), only if a slot needs it
    _stats_kernel    grid (NB,)  per block of BT tokens: scores, ranks, per-slot partial stats
    _sets_kernel     grid (P,)   per policy slot: reduce the partials, pick the batch set S
    _route_kernel    grid (NB,)  per token: allowed experts by its slot's kind, top-k inside

Stats rows (NSTAT, per slot and block): agg = summed scores, warm = union of top-k0, votes =
top-k counts, wsum = summed top-k weights, prot = Lynx-Acc protected, loaded = union of OEA
baselines, pool = union of XShare-spec request sets. Scores are >= 0, so -1 marks a disallowed
expert, -2 an already-ranked one and -3 padding. Ties go to the lower expert index everywhere.
"""

import triton
import triton.language as tl

from backend.selection import table as tb

NUM_STATS = 7  # stats rows per slot and block (the launcher sizes its scratch with it)
NSTAT = tl.constexpr(NUM_STATS)
AGG, WARM, VOTES, WSUM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
PROT, LOADED, POOL = tl.constexpr(4), tl.constexpr(5), tl.constexpr(6)
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
def _scores(logits_ptr, stride, rows, row_ok, cols, E, SIGMOID: tl.constexpr):
    """[BT, E_PAD] float32 gating scores; -3 outside the batch or the experts."""
    ok = row_ok[:, None] & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows[:, None] * stride + cols[None, :], mask=ok, other=-float("inf")).to(tl.float32)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        top = tl.max(x, axis=1)
        top = tl.where(top == -float("inf"), 0.0, top)
        ex = tl.exp(x - top[:, None])
        s = ex / tl.maximum(tl.sum(ex, axis=1), 1e-30)[:, None]
    return tl.where(ok, s, -3.0)


@triton.jit
def _ranks(s, cols, W: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, E_PAD: tl.constexpr):
    """Ranks of each token's W best experts ([BT, E_PAD], W elsewhere) and its top-K scores [BT, KP]."""
    kcols = tl.arange(0, KP)
    rank = tl.full(s.shape, W, tl.int32)
    vals = tl.zeros((s.shape[0], KP), tl.float32)
    x = s
    for j in range(W):
        top = tl.max(x, axis=1)
        idx = tl.min(tl.where(x == top[:, None], cols[None, :], E_PAD), axis=1)
        sel = (cols[None, :] == idx[:, None]) & (top[:, None] >= 0)
        rank = tl.where(sel, j, rank)
        x = tl.where(sel, -2.0, x)
        vals = tl.where((kcols[None, :] == j) & (top[:, None] >= 0), top[:, None], vals)
    return rank, vals


@triton.jit
def _baseline(vals, k0, p, K: tl.constexpr, KP: tl.constexpr):
    """[BT] OEA baseline size: max(k0, 1), or with p >= 0 the top-K mass prefix reaching p."""
    kcols = tl.arange(0, KP)
    total = tl.sum(tl.where(kcols[None, :] < K, vals, 0.0), axis=1)
    before = tl.zeros_like(total)
    count = tl.zeros_like(total)
    for j in range(K):
        count += (before < p * total).to(tl.float32)
        before += tl.sum(tl.where(kcols[None, :] == j, vals, 0.0), axis=1)
    floor = tl.maximum(k0, 1.0)
    return tl.where(p < 0, floor, tl.maximum(count, floor))


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
def _request_kernel(logits_ptr, stride, E, params_ptr, pid_ptr, req_start_ptr, req_end_ptr, reqset_ptr,
                    K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, E_PAD: tl.constexpr,
                    NCOL: tl.constexpr, SIGMOID: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    ok = cols < E
    start = tl.load(req_start_ptr + r)
    end = tl.load(req_end_ptr + r)
    slot = tl.load(pid_ptr + start)
    k0 = tl.load(params_ptr + slot * NCOL + _K0)
    mr = tl.load(params_ptr + slot * NCOL + _MR)
    agg = tl.zeros((E_PAD,), tl.float32)
    warm = tl.zeros((E_PAD,), tl.int32)
    for t0 in range(start, end, BT):
        rows = t0 + tl.arange(0, BT)
        s = _scores(logits_ptr, stride, rows, rows < end, cols, E, SIGMOID)
        rank, vals = _ranks(s, cols, K, K, KP, E_PAD)
        agg += tl.sum(tl.where(s >= 0, s, 0.0), axis=0)
        warm = tl.maximum(warm, tl.max((rank.to(tl.float32) < k0).to(tl.int32), axis=0))
    w = (warm > 0) & ok
    fresh = ok & ~w
    room = mr - tl.sum(w.to(tl.float32), axis=0)
    rk = _pair_rank(-agg, tl.zeros_like(agg), fresh, tl.zeros_like(cols), cols)
    chosen = w | (fresh & (rk.to(tl.float32) < room))
    tl.store(reqset_ptr + r * E_PAD + cols, chosen.to(tl.int8))


@triton.jit
def _stats_kernel(logits_ptr, stride, T, E, params_ptr, pid_ptr, rid_ptr, reqset_ptr, part_ptr, NP,
                  K: tl.constexpr, W: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, E_PAD: tl.constexpr,
                  NCOL: tl.constexpr, SIGMOID: tl.constexpr, HAS_REQ: tl.constexpr):
    nb = tl.program_id(0)
    rows = nb * BT + tl.arange(0, BT)
    row_ok = rows < T
    cols = tl.arange(0, E_PAD)
    s = _scores(logits_ptr, stride, rows, row_ok, cols, E, SIGMOID)
    rank, vals = _ranks(s, cols, W, K, KP, E_PAD)
    slot = tl.load(pid_ptr + rows, mask=row_ok, other=-1)
    prm = params_ptr + tl.maximum(slot, 0) * NCOL
    k0 = tl.load(prm + _K0, mask=row_ok, other=0.0)
    conf = tl.load(prm + _CONF, mask=row_ok, other=-1.0)
    base = _baseline(vals, k0, tl.load(prm + _P, mask=row_ok, other=-1.0), K, KP)
    rankf = rank.to(tl.float32)
    valid = s >= 0
    in_top = valid & (rank < K)
    total = tl.sum(tl.where(tl.arange(0, KP)[None, :] < K, vals, 0.0), axis=1)
    top1 = tl.max(vals, axis=1)
    confident = (conf >= 0) & (top1 >= conf * total)
    agg = tl.where(valid, s, 0.0)
    warm = (valid & (rankf < k0[:, None])).to(tl.float32)
    votes = in_top.to(tl.float32)
    wsum = tl.where(in_top, s, 0.0)
    prot = (valid & (rank == 0) & confident[:, None]).to(tl.float32)
    loaded = (valid & (rankf < base[:, None])).to(tl.float32)
    pool = tl.zeros_like(agg)
    if HAS_REQ:
        req = tl.load(rid_ptr + rows, mask=row_ok, other=0)
        held = tl.load(reqset_ptr + req[:, None] * E_PAD + cols[None, :], mask=row_ok[:, None], other=0)
        pool = (valid & (held != 0)).to(tl.float32)
    for p in range(NP):
        mine = (slot == p)[:, None]
        out = part_ptr + (nb * NP + p) * NSTAT * E_PAD + cols
        tl.store(out + AGG * E_PAD, tl.sum(tl.where(mine, agg, 0.0), axis=0))
        tl.store(out + WARM * E_PAD, tl.max(tl.where(mine, warm, 0.0), axis=0))
        tl.store(out + VOTES * E_PAD, tl.sum(tl.where(mine, votes, 0.0), axis=0))
        tl.store(out + WSUM * E_PAD, tl.sum(tl.where(mine, wsum, 0.0), axis=0))
        tl.store(out + PROT * E_PAD, tl.sum(tl.where(mine, prot, 0.0), axis=0))
        tl.store(out + LOADED * E_PAD, tl.max(tl.where(mine, loaded, 0.0), axis=0))
        tl.store(out + POOL * E_PAD, tl.max(tl.where(mine, pool, 0.0), axis=0))


@triton.jit
def _load_stat(part_ptr, NB, NP, p, which, cols, E_PAD: tl.constexpr, ACC_MAX: tl.constexpr):
    acc = tl.zeros((E_PAD,), tl.float32)
    for nb in range(NB):
        v = tl.load(part_ptr + ((nb * NP + p) * NSTAT + which) * E_PAD + cols)
        if ACC_MAX:
            acc = tl.maximum(acc, v)
        else:
            acc += v
    return acc


@triton.jit
def _fill(warm, cand, score, budget, cols, ok):
    """XShare's fill: warm plus the best-scoring fresh candidates until `budget` experts."""
    fresh = cand & ~warm & ok
    room = budget - tl.sum(warm.to(tl.float32), axis=0)
    rk = _pair_rank(-score, tl.zeros_like(score), fresh, tl.zeros_like(cols), cols)
    return warm | (fresh & (rk.to(tl.float32) < room))


@triton.jit
def _sets_kernel(part_ptr, NB, NP, E, params_ptr, static_ptr, groups_ptr, sets_ptr,
                 E_PAD: tl.constexpr, NCOL: tl.constexpr):
    p = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    ok = cols < E
    prm = params_ptr + p * NCOL
    kind = tl.load(prm + _KIND).to(tl.int32)
    agg = _load_stat(part_ptr, NB, NP, p, AGG, cols, E_PAD, False)
    warm = (_load_stat(part_ptr, NB, NP, p, WARM, cols, E_PAD, True) > 0) & ok
    votes = _load_stat(part_ptr, NB, NP, p, VOTES, cols, E_PAD, False)
    zero = tl.zeros_like(agg)
    chosen = ok
    if kind == _XSHARE:
        chosen = _nonempty(_fill(warm, agg >= tl.load(prm + _TAU), agg, tl.load(prm + _M), cols, ok),
                           agg, cols, ok, E_PAD)
    elif kind == _XSHARE_SPEC:
        pool = _load_stat(part_ptr, NB, NP, p, POOL, cols, E_PAD, True) > 0
        chosen = _nonempty(_fill(warm, pool, agg, tl.load(prm + _M), cols, ok), agg, cols, ok, E_PAD)
    elif kind == _XSHARE_EP:
        grp = tl.load(groups_ptr + cols, mask=ok, other=-1)
        same = grp[None, :] == grp[:, None]
        room = tl.load(prm + _MG) - tl.sum((same & warm[None, :]).to(tl.float32), axis=1)
        rk = _pair_rank(-agg, zero, ok & ~warm, grp, cols)
        chosen = _nonempty(warm | (ok & ~warm & (rk.to(tl.float32) < room)), agg, cols, ok, E_PAD)
    elif kind == _OEA_KIND:
        chosen = (_load_stat(part_ptr, NB, NP, p, LOADED, cols, E_PAD, True) > 0) & ok
    elif kind == _LYNX:
        active = (votes > 0) & ok
        prot = _load_stat(part_ptr, NB, NP, p, PROT, cols, E_PAD, False)
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
            key = _load_stat(part_ptr, NB, NP, p, WSUM, cols, E_PAD, False)
        elif code == _RANK_STATIC:
            key = tl.load(static_ptr + p * E + cols, mask=ok, other=0.0)
        rk = _pair_rank(-key, zero, used, tl.zeros_like(cols), cols)
        chosen = used & (rk.to(tl.float32) < tl.load(prm + _BUDGET))
    tl.store(sets_ptr + p * E_PAD + cols, chosen.to(tl.int8))


@triton.jit
def _route_kernel(logits_ptr, stride, T, E, params_ptr, pid_ptr, rid_ptr, reqset_ptr, sets_ptr,
                  router_w_ptr, router_ids_ptr, out_w_ptr, out_ids_ptr, scale,
                  K: tl.constexpr, W: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
                  E_PAD: tl.constexpr, NCOL: tl.constexpr, SIGMOID: tl.constexpr, HAS_REQ: tl.constexpr,
                  HAS_ROUTER: tl.constexpr, RENORM: tl.constexpr):
    nb = tl.program_id(0)
    rows = nb * BT + tl.arange(0, BT)
    row_ok = rows < T
    cols = tl.arange(0, E_PAD)
    kcols = tl.arange(0, KP)
    s = _scores(logits_ptr, stride, rows, row_ok, cols, E, SIGMOID)
    rank, vals = _ranks(s, cols, W, K, KP, E_PAD)
    slot = tl.maximum(tl.load(pid_ptr + rows, mask=row_ok, other=0), 0)
    prm = params_ptr + slot * NCOL
    kind = tl.load(prm + _KIND, mask=row_ok, other=0.0).to(tl.int32)[:, None]
    subst = tl.load(prm + _SUBST, mask=row_ok, other=0.0)[:, None]
    valid = s >= 0
    rankf = rank.to(tl.float32)
    sets = (tl.load(sets_ptr + slot[:, None] * E_PAD + cols[None, :], mask=row_ok[:, None], other=0) != 0) & valid
    allowed = sets
    if HAS_REQ:
        req = tl.load(rid_ptr + rows, mask=row_ok, other=0)
        held = tl.load(reqset_ptr + req[:, None] * E_PAD + cols[None, :], mask=row_ok[:, None], other=0) != 0
        spec = held & sets
        spec = tl.where(tl.max(spec.to(tl.int32), axis=1)[:, None] > 0, spec, sets)
        allowed = tl.where(kind == _XSHARE_SPEC, spec, allowed)
    base = _baseline(vals, tl.load(prm + _K0, mask=row_ok, other=0.0),
                     tl.load(prm + _P, mask=row_ok, other=-1.0), K, KP)
    maxp = tl.load(prm + _MAXP, mask=row_ok, other=0.0)
    oea = valid & ((rankf < base[:, None]) | ((rankf < maxp[:, None]) & sets))
    truncated = sets & (rank < K)
    cut = (subst == 0) & (tl.max(truncated.to(tl.int32), axis=1)[:, None] > 0)
    allowed = tl.where(kind == _OEA_KIND, oea, allowed)
    allowed = tl.where(kind == _MOE_SPEC, tl.where(cut, truncated, sets), allowed)
    allowed = tl.where(kind == _KEEP, valid, allowed)
    cap = tl.where((kind == _MOE_SPEC) & (subst == 0) & ~cut, 1, K)              # [BT, 1]
    x = tl.where(allowed, s, tl.where(valid, -1.0, -3.0))
    ws = tl.zeros((BT, KP), tl.float32)
    ids = tl.zeros((BT, KP), tl.int32)
    for j in tl.static_range(K):
        top = tl.max(x, axis=1)
        idx = tl.min(tl.where(x == top[:, None], cols[None, :], E_PAD), axis=1)
        used = (top[:, None] >= 0) & (j < cap)
        ws = tl.where((kcols[None, :] == j) & used, top[:, None], ws)
        ids = tl.where(kcols[None, :] == j, tl.where(used, idx[:, None], -1), ids)
        x = tl.where(cols[None, :] == idx[:, None], -2.0, x)
    first = tl.sum(tl.where(kcols[None, :] == 0, ids, 0), axis=1)
    ids = tl.where(ids < 0, first[:, None], ids)
    if RENORM:
        ws = ws / tl.maximum(tl.sum(ws, axis=1), 1.1754943508222875e-38)[:, None]
    ws = ws * scale
    kmask = row_ok[:, None] & (kcols[None, :] < K)
    offs = rows[:, None] * K + kcols[None, :]
    if HAS_ROUTER:
        keep = kind == _KEEP
        ws = tl.where(keep, tl.load(router_w_ptr + offs, mask=kmask, other=0.0).to(tl.float32), ws)
        ids = tl.where(keep, tl.load(router_ids_ptr + offs, mask=kmask, other=0).to(tl.int32), ids)
    tl.store(out_w_ptr + offs, ws, mask=kmask)
    tl.store(out_ids_ptr + offs, ids.to(tl.int64), mask=kmask)
