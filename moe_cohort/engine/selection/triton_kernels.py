"""Triton kernels for table-driven expert selection (imported only where Triton is installed).

Same decisions as `engine.selection.table_torch.route_tables` (the reference these are tested
against; the papers are cited in the per-policy modules), as three launches per MoE
layer, none with a host synchronisation (S is computed once per policy slot in a launch of its own:
recomputing it in every route program would save a launch but costs more on the GPU):

    _stats_kernel    grid (NB [+ R])  per block of BT tokens: scores, ranks, per-slot partial
                                      stats; with XShare-spec also one program per request:
                                      its request set (Alg. 3)
    _sets_kernel     grid (P,)        per policy slot: its batch set S from every block's stats
    _route_kernel    grid (NB,)       per token: the allowed experts by its slot's kind and S,
                                      and its top-k inside them

Stats rows (NSTAT, per slot and block): agg = summed scores, warm = union of top-k0, votes =
top-k counts, wsum = summed top-k weights, prot = Lynx-Acc protected, loaded = union of OEA
baselines; XShare-spec's pool (the union of its request sets) is read from the request sets.
Scores are >= 0, so -1 marks a disallowed expert, -2 an already-ranked one and -3 padding. Ties
go to the lower expert index everywhere.
"""

import triton
import triton.language as tl

from moe_cohort.engine.selection.triton_sets import (  # noqa: F401  (constexpr globals the kernels read)
    _CONF, _K0, _KEEP, _KIND, _MAXP, _MOE_SPEC, _MR, _OEA_KIND, _P, _SUBST, _XSHARE_SPEC, AGG, LOADED,
    NSTAT, NUM_STATS, PROT, VOTES, WARM, WSUM, _pair_rank, _slot_set,
)


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
def _request_set(r, logits_ptr, stride, E, params_ptr, pid_ptr, req_start_ptr, req_end_ptr, reqset_ptr,
                 K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, E_PAD: tl.constexpr,
                 NCOL: tl.constexpr, SIGMOID: tl.constexpr):
    """XShare Alg. 3 for request r: the warm-up of its tokens, filled by its summed score to mr."""
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
def _stats_kernel(logits_ptr, stride, T, E, params_ptr, pid_ptr, req_start_ptr, req_end_ptr, reqset_ptr,
                  part_ptr, NB, NP, K: tl.constexpr, W: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
                  E_PAD: tl.constexpr, NCOL: tl.constexpr, SIGMOID: tl.constexpr):
    """Programs 0..NB-1: one block's partial stats; programs NB.. (XShare-spec only): one request's set."""
    program = tl.program_id(0)
    if program < NB:
        _stats_block(program, logits_ptr, stride, T, E, params_ptr, pid_ptr, part_ptr, NP,
                     K, W, KP, BT, E_PAD, NCOL, SIGMOID)
    else:
        _request_set(program - NB, logits_ptr, stride, E, params_ptr, pid_ptr, req_start_ptr, req_end_ptr,
                     reqset_ptr, K, KP, BT, E_PAD, NCOL, SIGMOID)


@triton.jit
def _stats_block(nb, logits_ptr, stride, T, E, params_ptr, pid_ptr, part_ptr, NP,
                 K: tl.constexpr, W: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, E_PAD: tl.constexpr,
                 NCOL: tl.constexpr, SIGMOID: tl.constexpr):
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
    for p in range(NP):
        mine = (slot == p)[:, None]
        out = part_ptr + (nb * NP + p) * NSTAT * E_PAD + cols
        tl.store(out + AGG * E_PAD, tl.sum(tl.where(mine, agg, 0.0), axis=0))
        tl.store(out + WARM * E_PAD, tl.max(tl.where(mine, warm, 0.0), axis=0))
        tl.store(out + VOTES * E_PAD, tl.sum(tl.where(mine, votes, 0.0), axis=0))
        tl.store(out + WSUM * E_PAD, tl.sum(tl.where(mine, wsum, 0.0), axis=0))
        tl.store(out + PROT * E_PAD, tl.sum(tl.where(mine, prot, 0.0), axis=0))
        tl.store(out + LOADED * E_PAD, tl.max(tl.where(mine, loaded, 0.0), axis=0))

@triton.jit
def _sets_kernel(part_ptr, NB, NP, E, params_ptr, static_ptr, groups_ptr, pid_ptr, req_start_ptr, req_end_ptr,
                 reqset_ptr, R, sets_ptr, NB_PAD: tl.constexpr, R_PAD: tl.constexpr, E_PAD: tl.constexpr,
                 NCOL: tl.constexpr):
    """Program p: slot p's batch set S from every block's partial stats."""
    p = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    chosen = _slot_set(part_ptr, NB, NP, p, E, params_ptr, static_ptr, groups_ptr, cols,
                       pid_ptr, req_start_ptr, req_end_ptr, reqset_ptr, R, NB_PAD, R_PAD, E_PAD, NCOL)
    tl.store(sets_ptr + p * E_PAD + cols, chosen.to(tl.int8))


@triton.jit
def _route_kernel(logits_ptr, stride, T, E, params_ptr, pid_ptr, rid_ptr, reqset_ptr, sets_ptr,
                  router_w_ptr, router_ids_ptr, out_w_ptr, out_ids_ptr, scale,
                  before_ptr, after_ptr, rec_w_ptr,
                  K: tl.constexpr, W: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
                  E_PAD: tl.constexpr, NCOL: tl.constexpr, SIGMOID: tl.constexpr, HAS_REQ: tl.constexpr,
                  HAS_ROUTER: tl.constexpr, RENORM: tl.constexpr, RECORD: tl.constexpr, RANKED: tl.constexpr):
    nb = tl.program_id(0)
    rows = nb * BT + tl.arange(0, BT)
    row_ok = rows < T
    cols = tl.arange(0, E_PAD)
    kcols = tl.arange(0, KP)
    s = _scores(logits_ptr, stride, rows, row_ok, cols, E, SIGMOID)
    if RANKED:   # only OEA and MoE-Spec read ranks here
        rank, vals = _ranks(s, cols, W, K, KP, E_PAD)
    else:
        rank, vals = tl.full(s.shape, W, tl.int32), tl.zeros((BT, KP), tl.float32)
    slot = tl.load(pid_ptr + rows, mask=row_ok, other=-1)
    slot = tl.maximum(slot, 0)
    sets = tl.load(sets_ptr + slot[:, None] * E_PAD + cols[None, :], mask=row_ok[:, None], other=0)
    prm = params_ptr + slot * NCOL
    kind = tl.load(prm + _KIND, mask=row_ok, other=0.0).to(tl.int32)[:, None]
    subst = tl.load(prm + _SUBST, mask=row_ok, other=0.0)[:, None]
    valid = s >= 0
    rankf = rank.to(tl.float32)
    sets = (sets != 0) & valid
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
        router_ids = tl.load(router_ids_ptr + offs, mask=kmask, other=0).to(tl.int32)
        ws = tl.where(keep, tl.load(router_w_ptr + offs, mask=kmask, other=0.0).to(tl.float32), ws)
        ids = tl.where(keep, router_ids, ids)
        if RECORD:   # what the router chose, for the expert-load metrics
            tl.store(before_ptr + offs, router_ids, mask=kmask)
    if RECORD:
        tl.store(after_ptr + offs, ids, mask=kmask)
        tl.store(rec_w_ptr + offs, ws, mask=kmask)
    tl.store(out_w_ptr + offs, ws.to(out_w_ptr.dtype.element_ty), mask=kmask)
    tl.store(out_ids_ptr + offs, ids.to(out_ids_ptr.dtype.element_ty), mask=kmask)
