"""What the proxy and the engine say to each other: the keys of a request's `vllm_xargs` that moe-cohort owns.

The proxy writes them into the body it forwards; vLLM hands them to the engine as
`sampling_params.extra_args`, where the plugin (backend/) and the expert-aware scheduler read them.
One module for both sides, so a renamed key cannot leave one side behind.

- `ROUTING_KEY`: the request's routing policy string (backend.policy's grammar), e.g. "xshare;m=24".
- `PROFILE_KEY`: the request's predicted expert profile in compact form (encoder.profile.compact),
  for an engine that admits from its own queue by the same rule (backend.scheduler).
- `RECORD_KEY`: whether the plugin records this request's expert trace.
"""

from __future__ import annotations

ROUTING_KEY = "moe_routing"
PROFILE_KEY = "moe_profile"
RECORD_KEY = "moe_record"
