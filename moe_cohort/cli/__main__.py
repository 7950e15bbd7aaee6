"""`python -m moe_cohort.cli ARGS`: the `cohort` command."""

from moe_cohort.cli import main

raise SystemExit(main())
