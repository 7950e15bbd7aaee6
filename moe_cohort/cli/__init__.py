"""The `cohort` command: a dispatcher, nothing else.

Each subcommand is a module of this package with two functions, `add_arguments(parser)` and
`run(args) -> int`. The module is imported only when its
subcommand runs, so `cohort eval` never pays for torch or vLLM imports.

Every parser here reports a bad argument in one line (what is wrong, and `--help` for the rest)
with exit code 2, and shows each flag's default in `--help`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default X)" to a flag's help unless the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or default in (None, False, argparse.SUPPRESS)
                or isinstance(default, bool)):
            return text
        return f"{text} (default %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block), the defaults in --help, and each flag by its whole
    name only (no prefix of it: a prefix would be a second name, and an old name that is a prefix of a new
    one would still be taken)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("moe-cohort")
    except PackageNotFoundError:
        return "unknown (not installed)"


def quiet_loading_bars() -> None:
    """No "Loading weights" / download bars from transformers and huggingface_hub (for --no-progress,
    and in `cohort serve`, whose log is no terminal); set before they import where possible."""
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # transformers reads this state when it is imported
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


VERBOSE = "verbose"  # the attribute -v counts into (one per parser level: verbose, verbose1, ...)

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("moe_cohort.cli.serve", "run the OpenAI-compatible proxy in front of vLLM (or an embedded tiny-MoE vLLM)"),
    "compare": ("moe_cohort.cli.compare", "on a running `cohort serve`: held-out prompts first come, first served "
                "and through admission, decode expert loads per generated token of each"),
    "batch": ("moe_cohort.cli.batch", "run an OpenAI Batch file through vLLM, each line admitted when a slot frees; "
                                      "resumable after a crash"),
    "eval": ("moe_cohort.cli.eval", "compare static batching plans on expert traces against random and an oracle"),
    "replay": ("moe_cohort.cli.replay", "replay vLLM's continuous batching on expert traces under each admission policy"),
    "traces": ("moe_cohort.cli.traces", "inspect, import and convert expert-trace files"),
    "plan": ("moe_cohort.cli.plan", "turn prompts (JSONL) into expert-coherent batches from their text alone"),
    "train": ("moe_cohort.cli.train", "fine-tune a sentence encoder on expert traces to predict each request's "
              "expert profile, and fit the profile head that admission reads"),
    "make-tiny-moe": ("moe_cohort.cli.make_tiny_moe", "write a tiny random MoE model (Qwen3-MoE, Mixtral, OLMoE) for tests"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="cohort", description="moe-cohort: expert-coherent batching for Mixture-of-Experts serving.")
    parser.add_argument("--version", action="version", version=f"moe-cohort {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text)
    return parser


def add_verbose(parser: argparse.ArgumentParser, depth: int = 0) -> None:
    """-v/--verbose on `parser` and on every parser below it (`cohort batch run ... -v` as `cohort batch -v run`).
    Each level counts into its own attribute: a subparser's default would overwrite what the level above
    counted (argparse copies a subparser's whole namespace up); `verbosity` adds them."""
    parser.add_argument("-v", "--verbose", action="count", default=0, dest=f"{VERBOSE}{depth or ''}",
                        help="more log output (-vv for debug)")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                add_verbose(sub, depth + 1)


def verbosity(args: argparse.Namespace) -> int:
    """How many -v were given, at every level of the command."""
    return sum(value for key, value in vars(args).items() if key.startswith(VERBOSE))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        build_parser().parse_args(argv)  # prints help, the version, or "invalid choice" and exits
        return 2
    name = argv[0]
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = ArgumentParser(prog=f"cohort {name}", description=help_text)
    module.add_arguments(parser)
    add_verbose(parser)
    args = parser.parse_args(argv[1:])
    if getattr(args, "no_progress", False):
        quiet_loading_bars()
    level = max(logging.WARNING - 10 * verbosity(args), logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    return int(module.run(args) or 0)

if __name__ == "__main__":
    raise SystemExit(main())
