"""One request from the proxy (or a batch line) to a vLLM backend: settings, the handshake and the plan it leads to,
admission to the backend's slots, the backend client, and the metrics; no web framework."""
