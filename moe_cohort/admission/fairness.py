"""The fairness bounds, one pair wherever a queue is reordered (the proxy, vLLM's queue under our scheduler, Ray
Serve): whichever bound a waiting request reaches first sends it next (admission.waiting). They trade the saving
against the latency tail (docs/results.md, "Fairness against the saving"). No imports: settings read these too."""

MAX_WAIT_S = 30.0  # a request that has waited this long goes first
PASSED_PER_SLOT = 3  # later arrivals admitted before a waiting request, per slot, before it goes first
