"""benchmarks/bench_batch_out_of_box.py: each kind of run is set against its own file's order, round by round."""

from __future__ import annotations

from benchmarks import bench_batch_out_of_box


def _row(kind, r, loads, wall=10.0, cpu=1.0):
    return {"kind": kind, "round": r, "loads_per_token": loads, "tokens_per_forward": 15.5, "wall_s": wall,
            "cpu_s": cpu, "once": True}


def test_a_new_files_warm_run_is_set_against_that_files_order_not_the_first_files():
    rows = [_row("file", 0, 10.0), _row("cold", 0, 9.0), _row("warm", 0, 8.0), _row("new-file", 0, 20.0),
            _row("new-warm", 0, 19.0), _row("file", 1, 10.0), _row("cold", 1, 9.5), _row("warm", 1, 8.0),
            _row("new-file", 1, 20.0), _row("new-warm", 1, 18.0)]
    cold, warm, new = bench_batch_out_of_box.summary(rows)
    assert cold.startswith("cold against file order over 2 rounds: +7.5% +- 2.5%")
    assert warm.startswith("warm against file order over 2 rounds: +20.0% +- 0.0%")
    assert new.startswith("new-warm against new-file order over 2 rounds: +7.5% +- 2.5% fewer decode loads per "
                          "generated token (each round: +5.0%, +10.0%)")


def test_without_a_new_file_the_summary_has_no_line_for_it():
    rows = [_row("file", 0, 10.0), _row("cold", 0, 9.0), _row("warm", 0, 8.0)]
    assert [line.split()[0] for line in bench_batch_out_of_box.summary(rows)] == ["cold", "warm"]
