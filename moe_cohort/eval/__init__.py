"""Evaluation on recorded expert traces: the cost model, the oracle and the policies replayed against it, and the
reports `cohort eval` and `cohort replay` print."""
