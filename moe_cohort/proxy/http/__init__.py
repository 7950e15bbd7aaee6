"""The HTTP layer under the proxy's routes: request context and access log, head limits, the fast path of the hot
routes, OpenAI-shaped errors."""
