"""The measurements behind the figures of README.md and docs/results.md, one script a question.

Run from the repository root as modules, e.g. `python -m benchmarks.bench_continuous --help`; the
data they read lives in $COHORT_DATA (default ../shared/data: benchmarks.heldout.data_dir).
Not installed with the package (pyproject.toml lists the packages it ships).
"""
