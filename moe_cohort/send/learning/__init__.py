"""Learning while serving: the engine's per-request expert counts taken back, and the profile head refit from them off
the request path."""
