"""The package's public surface (moe_cohort/__init__.py): each name is the object of its module, loaded on first
use; `import moe_cohort` alone loads none of them (vLLM's plugin loader imports it in every vLLM process)."""

import json
import subprocess
import sys

import pytest

import moe_cohort


def test_each_public_name_is_its_modules_object():
    from moe_cohort.batch.file_run import FileJob, run_file
    from moe_cohort.proxy.app import create_app
    from moe_cohort.send.setting_sources import load_settings
    from moe_cohort.send.settings import Settings

    assert (moe_cohort.Settings, moe_cohort.load_settings, moe_cohort.create_app, moe_cohort.run_file,
            moe_cohort.FileJob) == (Settings, load_settings, create_app, run_file, FileJob)
    assert set(moe_cohort.__all__) >= {"Settings", "run_file", "ExpertAwareScheduler", "ExpertAffinityRouter"}
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        moe_cohort.nothing_here


@pytest.mark.integration
def test_importing_the_package_loads_nothing_of_it():
    code = "import sys, json, moe_cohort; print(json.dumps(sorted(m for m in sys.modules if m.startswith('moe_cohort.'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
