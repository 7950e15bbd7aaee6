"""Engine hints from clients: which of a request's `vllm_xargs` keys the proxy lets through.

moe-cohort's keys (admission/wire.py) tell the engine's plugin and scheduler what to do with a request.
Two of them are the proxy's own, never a client's:

- `moe_profile`: the predicted expert profile the expert-aware scheduler admits by; a client that wrote
  its own could claim whatever profile puts it first in the engine's queue. The proxy writes its own
  prediction there (--forward-profiles) and otherwise sends none.
- `moe_record`: makes the plugin write the request's expert trace (with its token ids) to disk on
  the engine's host.
- `moe_observe`: makes the plugin count the request's experts for the proxy's online learning (--learn);
  a client's own token would mix its requests into what the proxy learns from.

The proxy drops these from every client body (chat, completions, responses, batch lines) unless the operator
trusts its callers (`trust_client_hints`, e.g. a gateway in front that predicts profiles itself).
`moe_routing`, the routing policy, is the product's API and stays the client's to choose, within the
operator's list when there is one (`allowed_policies`: policy names, any parameters, or exact policies;
the server's default policy is always allowed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from moe_cohort.admission.wire import OBSERVE_KEY, PROFILE_KEY, RECORD_KEY

OWNED_BY_PROXY = (PROFILE_KEY, RECORD_KEY, OBSERVE_KEY)


@dataclass(frozen=True)
class HintRules:
    trust_client: bool = False  # clients may send moe_profile and moe_record
    policies: tuple[str, ...] = ()  # canonical entries (`canonical_policies`); empty: any policy

    @classmethod
    def of(cls, settings) -> "HintRules":
        """The rules of the proxy's `settings` (send/settings.py; its allowed_policies are canonical already)."""
        return cls(settings.trust_client_hints, settings.allowed_policies)

    def allows(self, policy: str) -> bool:
        """Whether clients may ask for the canonical `policy`."""
        return not self.policies or policy in self.policies or policy.partition(";")[0] in self.policies

    def client_xargs(self, xargs: dict) -> dict:
        """A client's `vllm_xargs` without the keys the proxy owns (unless callers are trusted)."""
        if self.trust_client or not any(key in xargs for key in OWNED_BY_PROXY):
            return xargs
        return {key: value for key, value in xargs.items() if key not in OWNED_BY_PROXY}


def canonical_policies(entries: Iterable[str]) -> tuple[str, ...]:
    """The operator's allowed policies, each a name (any parameters) or a full policy in canonical form;
    PolicyError (a ValueError) for an entry that is neither."""
    from moe_cohort.engine.policy import POLICY_NAMES, parse_policy

    out = []
    for entry in entries:
        text = entry.strip().lower()
        out.append(text if text in POLICY_NAMES else str(parse_policy(entry.strip())))
    return tuple(dict.fromkeys(out))
