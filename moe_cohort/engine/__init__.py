"""What runs inside the engine: the routing-policy grammar and the batch-aware expert selectors.

`engine.policy` is pure Python (the proxy imports it without torch); `engine.selection` is pure
torch and imports no vLLM.
"""
