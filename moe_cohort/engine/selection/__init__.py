"""Batch-aware expert selectors: router logits of a batch -> each token's experts.

    select_experts(router_logits, top_k, policy, *, request_spans=None, expert_groups=None,
                   is_prefill=False, scoring="softmax", renormalize=True)
        -> (topk_weights [T, top_k] float32, topk_ids [T, top_k] int64)

`policy` is a `engine.policy.Policy` or its string form. `SELECTORS` maps every policy name to
its selector (same contract, typed policy). `select_experts_mixed` routes a batch whose requests
carry different policies. Every selector traces under `torch.compile(fullgraph=True)`; request
spans and policies are Python values there (guarded, so a new span layout recompiles).

On CUDA (with Triton installed) `select_experts` runs the fused Triton kernels
(`fused`, `triton_kernels`): a few launches per call, no host synchronisation, CUDA-graph safe.
They read policies from a parameter table (`table`); `table_torch` is their torch twin (the CPU
path of table-driven routing), and `step_tables` keeps such tables persistent for an engine, so
per-request policies need no re-capture or re-compile. The torch selectors stay the CPU path and
the reference. No vLLM import; Triton is imported only when a kernel first runs.
"""

from moe_cohort.engine.selection import lynx, moe_spec, oea, xshare  # noqa: F401  (register selectors)
from moe_cohort.engine.selection.base import SELECTORS, gate_scores, select_topk
from moe_cohort.engine.selection.dispatch import select_experts, select_experts_mixed
from moe_cohort.engine.selection.moe_spec import load_calibration

__all__ = [
    "SELECTORS", "gate_scores", "load_calibration", "select_experts", "select_experts_mixed",
    "select_topk",
]
