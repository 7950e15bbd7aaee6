"""Which rows of a forward pass belong to which request, and what each request asked for.

vLLM's forward context carries no request ids, so the plugin publishes a `Step` before every
model forward (from the model runner's batch) and the MoE routing hook reads it. Pure Python and
numpy: no vLLM import, so it is testable on its own.

Per-request options travel in the OpenAI request body as `"vllm_xargs": {...}`, which vLLM copies
into `SamplingParams.extra_args`:

    moe_routing   a policy string (engine.policy grammar), e.g. "xshare;m=4;k0=1"; default: the
                  server-wide policy (env COHORT_DEFAULT_POLICY, else "topk")
    moe_record    true/false: record this request's expert trace, honoured only where the operator lets
                  requests ask (env COHORT_RECORD_TRACES=request: those that ask; =1: all, a request
                  may opt out with false; =0, the default: none, and the API server refuses true)
    moe_observe   a token (a short string, the proxy's): count the request's experts under it for the proxy's
                  online learning (engine.observed_endpoint); counts only, no text
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from moe_cohort.admission.wire import OBSERVE_KEY, RECORD_KEY, ROUTING_KEY
from moe_cohort.engine.policy import Policy, PolicyError, TopK, parse_policy

PREFILL, DECODE, MIXED = "prefill", "decode", "mixed"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


MAX_TOKEN_CHARS = 128


@dataclass(frozen=True)
class RequestOptions:
    policy: Policy
    record: bool
    observe: str | None = None  # the moe_observe token its expert counts are kept under
    label: str = field(init=False, compare=False)  # canonical policy string (metric label), computed once

    def __post_init__(self) -> None:
        object.__setattr__(self, "label", str(self.policy))


def parse_flag(value: object, key: str = RECORD_KEY) -> bool:
    """A boolean request flag given as JSON bool, 0/1 or a word (true/false, yes/no, on/off)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"vllm_xargs.{key} must be true or false, got {value!r}")


class RecordingOff(ValueError):
    """A request asked to be recorded where the operator lets no request ask."""


def request_options(extra_args: Mapping | None, default_policy: Policy = TopK(),
                    record_default: bool = False, record_requests: bool = False, *,
                    strict: bool = False) -> RequestOptions:
    """The options of one request from its `SamplingParams.extra_args`. It is recorded when `record_default`
    (the operator records every request) unless it says `moe_record: false`, or when it says `moe_record:
    true` and `record_requests` (the operator lets requests ask); a request's `true` is ignored otherwise
    (`strict`: RecordingOff, the API server's 400), so a client cannot make the engine write its prompt to disk.

    Raises PolicyError (a ValueError) for a bad `moe_routing` and ValueError for a bad `moe_record`.
    """
    extra_args = extra_args or {}
    policy = default_policy
    if ROUTING_KEY in extra_args:
        text = extra_args[ROUTING_KEY]
        if not isinstance(text, str):
            raise PolicyError(f"vllm_xargs.{ROUTING_KEY} must be a policy string, got {text!r}")
        policy = parse_policy(text)
    record = record_default
    if RECORD_KEY in extra_args:
        asked = parse_flag(extra_args[RECORD_KEY])
        if asked and not (record_default or record_requests):
            if strict:
                raise RecordingOff("this server does not record requests on demand (its operator allows that "
                                   "with COHORT_RECORD_TRACES=request)")
        else:
            record = asked
    return RequestOptions(policy, record, observe_token(extra_args.get(OBSERVE_KEY)))


def observe_token(value: object) -> str | None:
    """A `moe_observe` value: None (absent) or a non-empty string of at most MAX_TOKEN_CHARS; ValueError otherwise."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TOKEN_CHARS:
        raise ValueError(f"vllm_xargs.{OBSERVE_KEY} must be a string of 1 to {MAX_TOKEN_CHARS} characters, got {value!r}")
    return value


class Span(NamedTuple):
    """The rows [start, end) of one request in a forward pass's batch (a tuple: built per step)."""

    req_id: str
    start: int
    end: int
    position: int  # sequence position of row `start` (tokens computed before this step)
    num_prompt_tokens: int
    options: RequestOptions

    @property
    def phase(self) -> str:
        return PREFILL if self.position < self.num_prompt_tokens else DECODE

    @property
    def rerouted(self) -> bool:
        """Whether a policy changes these rows: not top-k, and not a decode-only policy in prefill."""
        return not isinstance(self.effective_policy, TopK)

    @property
    def effective_policy(self) -> Policy:
        """The policy applied to these rows (`Policy.effective`: decode-only ones leave prefill at top-k)."""
        return self.options.policy.effective(self.phase == PREFILL)


@dataclass(frozen=True)
class Step:
    """One forward pass: its request spans and their (phase, policy) groups.

    Rows past `num_tokens` (if the batch is padded) belong to no request and are left alone.
    """

    spans: tuple[Span, ...]
    num_tokens: int
    groups: tuple[tuple[str, str], ...]  # [G] (phase, canonical policy string)
    token_group: np.ndarray  # [num_tokens] int64 group index of every row
    group_tokens: tuple[int, ...]  # [G] rows per group
    all_topk: bool  # every span's effective policy is top-k: routing stays as the router chose
    record: bool  # some span is recorded
    observe: bool = False  # some span's experts are counted (moe_observe)
    prefilling: bool = False  # some span holds prompt tokens (their routing is the request's profile)

    @property
    def steady(self) -> bool:
        """True for a decode-only batch that records and counts nothing: the next step with the same requests
        and token counts is the same Step (only positions advance, and nothing reads them then)."""
        return not self.record and not self.observe and all(s.position >= s.num_prompt_tokens for s in self.spans)

    @property
    def batch_labels(self) -> tuple[str, str]:
        """(phase, policy) of the whole batch; "mixed" where the groups differ."""
        phases = {phase for phase, _ in self.groups}
        policies = {policy for _, policy in self.groups}
        return (phases.pop() if len(phases) == 1 else MIXED, policies.pop() if len(policies) == 1 else MIXED)


def build_step(req_ids: Sequence[str], query_start_loc: Sequence[int], positions: Sequence[int],
               num_prompt_tokens: Sequence[int], options: Sequence[RequestOptions]) -> Step:
    """A Step from the runner's batch (plain Python ints: this runs before every forward).

    req_ids [R]; query_start_loc [R + 1] row offsets; positions [R] computed tokens before the step;
    num_prompt_tokens [R]; options [R].
    """
    spans = tuple(
        Span(rid, start, end, position, prompt, opts)
        for rid, start, end, position, prompt, opts in zip(
            req_ids, query_start_loc, query_start_loc[1:], positions, num_prompt_tokens, options)
        if end > start
    )
    group_of: dict[tuple[str, str], int] = {}
    span_groups = [group_of.setdefault((PREFILL if s.position < s.num_prompt_tokens else DECODE, s.options.label),
                                       len(group_of)) for s in spans]
    num_tokens = spans[-1].end if spans else 0
    if len(group_of) <= 1:  # the common case: one phase and one policy
        token_group = np.zeros(num_tokens, dtype=np.int64)
        group_tokens = [num_tokens] if group_of else []
    else:
        lengths = [s.end - s.start for s in spans]
        token_group = np.repeat(np.array(span_groups, dtype=np.int64), lengths)  # [n]
        group_tokens = [0] * len(group_of)
        for g, length in zip(span_groups, lengths):
            group_tokens[g] += length
    return Step(
        spans=spans, num_tokens=num_tokens,
        groups=tuple(group_of), token_group=token_group, group_tokens=tuple(group_tokens),
        all_topk=not any(s.rerouted for s in spans),
        record=any(s.options.record for s in spans),
        observe=any(s.options.observe for s in spans),
        prefilling=any(s.phase == PREFILL for s in spans),
    )
