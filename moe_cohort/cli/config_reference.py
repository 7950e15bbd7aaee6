"""The config reference (docs/configuration.md): every setting with its config key, variable, flag and the
commands that take it, default and meaning, then the COHORT_* variables that are no setting; made from the
settings table (send/settings.py) and the commands' flag tables. `python -m moe_cohort.cli.config_reference`
prints it."""

from __future__ import annotations

from moe_cohort.cli import batch, serve
from moe_cohort.send.settings import (ENGINE_READS, SECTIONS, FlagTable, Settings, flag_of,
                                      meaning_of, variable_of)

# The COHORT_* variables that are no setting: what each one sets, and what reads it.
OTHER_VARIABLES = {
    "COHORT_CONFIG": "the config file (YAML or TOML) `cohort serve` and `cohort batch run` read; their --config",
    "COHORT_CACHE_DIR": "where built models are cached: the static encoder, the trained tiny MoE (default "
                        "$XDG_CACHE_HOME/moe-cohort, else ~/.cache/moe-cohort)",
    "COHORT_DATA": "the data folder the tiny MoE's training reads its prompt set from (unset: templated prompts)",
    "COHORT_RECORD_TRACES": "vLLM's plugin: 1 records every request's experts, `request` those that ask "
                            "(vllm_xargs moe_record), 0 none",
    "COHORT_TRACE_DIR": "vLLM's plugin: where recorded traces go (default ./cohort-traces)",
    "COHORT_MOE_METRICS": "vLLM's plugin: 0 turns its expert-load metrics off (default 1)",
    "COHORT_ALLOW_UNTESTED_VLLM": "vLLM's plugin and scheduler: 1 patches a vLLM version they were not tested on",
    "COHORT_GRAPH_XSHARE_SPEC": "vLLM's plugin with CUDA graphs: 1 serves xshare-spec too (one more kernel per step)",
    "COHORT_GRAPH_RANK_WIDTH": "vLLM's plugin with CUDA graphs: experts ranked per token, the largest OEA max_p "
                               "served (default 2 x top_k)",
    "COHORT_PREFILL_AHEAD": "vLLM's ExpertAwareScheduler: requests prefilled and held beyond --max-num-seqs, admitted "
                            "to decode by their prompt's routing (default: 16 x max_num_seqs, within half the KV "
                            "cache; 0: off)",
    "COHORT_DIE_WITH_PARENT": "set by `cohort serve` for its embedded vLLM: each of its processes dies with its parent",
    "COHORT_METRICS_DIR": "set by vLLM's plugin for vLLM's own processes: where they write their metrics",
    "COHORT_RAY_OBSERVATIONS": "set by `ExpertAware` for Ray Data LLM's engine stage: the Ray actor it hands the "
                               "engine's expert counts to",
}


def command_flags() -> dict[str, FlagTable]:
    """The flag table of every command that takes settings: {"cohort serve": its table, ...}."""
    return {"cohort serve": serve._FLAGS, "cohort batch run": batch._FLAGS}


def reference() -> str:
    """The config reference in Markdown: one table per section (every setting: its config key, variable, flag
    and the commands that take it, default, meaning), then the COHORT_* variables that are no setting."""
    taken: dict[str, list[str]] = {}
    for command, table in command_flags().items():
        for dest, _, _ in table.values():
            taken.setdefault(dest, []).append(command.removeprefix("cohort "))
    lines = []
    for section, (about, names) in SECTIONS.items():
        lines += [f"### {section}: {about}", "", "| setting | variable | flag | default | meaning |",
                  "|---|---|---|---|---|"]
        for name in names:
            variable = f"`{variable_of(name)}`" + (" (vLLM too)" if name in ENGINE_READS else "")
            flag = f"`{flag_of(name)}` ({', '.join(taken[name])})" if name in taken else "-"
            default = Settings.__dataclass_fields__[name].default
            lines.append(f"| `{name}` | {variable} | {flag} | `{_shown(default)}` | {_cell(meaning_of(name))} |")
        lines.append("")
    lines += ["### other variables", "", "| variable | what it sets |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(text)} |" for name, text in OTHER_VARIABLES.items()]
    return "\n".join(lines) + "\n"


def _shown(default: object) -> str:
    """A default as a config file writes it."""
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, tuple):
        return "[" + ", ".join(default) + "]"
    return '""' if default == "" else str(default)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


if __name__ == "__main__":
    print(reference(), end="")
