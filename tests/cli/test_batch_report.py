"""cli/batch_report.py: the engine's decode counters in `cohort batch run`'s progress bar and summary."""

from types import SimpleNamespace

from moe_cohort.batch.core import RunStats
from moe_cohort.cli.batch_report import ProgressBar, summary
from moe_cohort.send.engine_counters import DecodeCounters

# by hand: 70 / 20 = 3.5 experts per layer-step, 1 - 70 / 100 = 30% saved, 72 / 18 = 4 loads per token,
# 18 * 4 layers / 24 = 3 tokens per forward
RAN = DecodeCounters(batch_before=100, batch_after=70, batch_layer_steps=20, loads=72, layer_forwards=24, tokens=18)
PATHS = SimpleNamespace(output="out.jsonl", errors="out.errors.jsonl")


def _stats(decode: DecodeCounters | None) -> RunStats:
    return RunStats(total=4, finished_before=0, clock=lambda: 10.0, started=8.0, succeeded=4, completion_tokens=100,
                    decode=decode)


def test_the_summary_prints_the_decode_figures_of_the_run(capsys):
    summary(_stats(RAN), {"output": 4, "errors": 0}, PATHS, layers=4, wall_s=3.0)
    err = capsys.readouterr().err
    assert "decode: 4.000 expert loads per generated token, 3.00 decode tokens per forward (" in err
    assert ("backend decode steps: 3.50 distinct experts per MoE layer (70 expert loads over 20 layer-steps), "
            "routing policy saved 30.0% of them") in err


def test_the_summary_leaves_out_what_it_cannot_tell(capsys):
    summary(_stats(DecodeCounters(loads=72, tokens=18)), {"output": 4, "errors": 0}, PATHS, layers=None, wall_s=3.0)
    err = capsys.readouterr().err
    assert "decode: 4.000 expert loads per generated token (" in err and "tokens per forward" not in err
    assert "backend decode steps" not in err  # no whole decode batch was counted
    for nothing in (DecodeCounters(), None):
        summary(_stats(nothing), {"output": 4, "errors": 0}, PATHS, layers=4, wall_s=3.0)
        err = capsys.readouterr().err
        assert "50 generated tokens/s" in err and "decode" not in err


def test_the_progress_bar_shows_the_experts_per_layer_step_and_the_policy_saving(capsys):
    with ProgressBar(total=4, finished=0, enabled=True) as bar:
        bar.update(_stats(RAN))
    assert "3.5 experts/layer/decode step (30.0% saved by the policy)" in capsys.readouterr().err
