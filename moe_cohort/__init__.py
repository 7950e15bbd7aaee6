"""moe-cohort: expert-coherent batching for Mixture-of-Experts serving."""

__version__ = "0.1.0"
