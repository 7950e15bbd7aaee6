"""The OpenAI-compatible HTTP service: routes, streamed and whole answers, health, and the Batch API; what it sends
goes through `send`."""
