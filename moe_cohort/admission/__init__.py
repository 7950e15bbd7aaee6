"""Which waiting request takes a free slot: the one rule (waiting.WaitingPool) over a resident set of experts or
embeddings, its fairness bounds, the replica router, and the wire form of what the proxy tells the engine. Pure
numpy: no HTTP, no vLLM."""
