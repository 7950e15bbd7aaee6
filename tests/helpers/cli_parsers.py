"""Every argparse parser of the `cohort` command, as `main` builds them."""

from __future__ import annotations

import argparse
import importlib

from moe_cohort.cli import SUBCOMMANDS, ArgumentParser, add_verbose


def parsers():
    """Every parser of every subcommand, sub-actions included (`cohort batch run`), as `main` builds them."""
    def below(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from below(sub)

    for name, (module_name, help_text) in SUBCOMMANDS.items():
        parser = ArgumentParser(prog=f"cohort {name}", description=help_text)
        importlib.import_module(module_name).add_arguments(parser)
        add_verbose(parser)
        yield from below(parser)
