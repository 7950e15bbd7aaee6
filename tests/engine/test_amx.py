"""engine/amx.py: our plugin gets Linux's permission for AMX state before vLLM's first forward."""

from __future__ import annotations

import pytest

from moe_cohort.engine import amx


def test_the_amx_flag_is_read_from_cpuinfo(tmp_path):
    with_amx, without = tmp_path / "a", tmp_path / "b"
    with_amx.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile amx_int8\n")
    without.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16\n")  # amx_bf16 alone is no tile
    assert amx.cpu_has_amx(str(with_amx)) and not amx.cpu_has_amx(str(without))
    assert not amx.cpu_has_amx(str(tmp_path / "missing"))


@pytest.mark.skipif(not amx.cpu_has_amx(), reason="this CPU has no AMX")
def test_on_an_amx_cpu_the_process_holds_amx_state_once_asked():
    assert amx.allow_amx()
    assert amx.holds_amx()


def test_without_amx_nothing_is_asked(monkeypatch):
    monkeypatch.setattr(amx, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(amx, "_arch_prctl", lambda *a: pytest.fail("asked Linux for AMX on a CPU without it"))
    assert not amx.allow_amx()
