"""Ray Serve deployment of the proxy's admission: a router that admits requests to vLLM replicas by the same rule."""
