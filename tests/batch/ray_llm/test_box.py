"""moe_cohort.batch.ray_llm.box: the box answers each wait once its condition holds, and its module loads no vLLM."""

import asyncio
import importlib.util
import json
import subprocess
import sys

import pytest

if importlib.util.find_spec("ray") is None:
    pytest.skip("the box is a Ray actor (bash scripts/setup.sh dev installs ray)", allow_module_level=True)
# here, not in a test: Ray subclasses subprocess.Popen when it is imported, and a quick test's Popen is conftest's guard
from moe_cohort.batch.ray_llm.box import Observations  # noqa: E402


def test_the_box_answers_a_wait_once_its_condition_holds():
    async def scenario():
        box = Observations()
        counted = asyncio.create_task(box.until(2, 10))  # two counts, or ten rows finished
        finished = asyncio.create_task(box.until(None, 3))  # three rows finished, counts or not
        part = asyncio.create_task(box.handed_over(0))
        await box.put({"a": {}})
        await box.put({})  # finished without counts
        await asyncio.sleep(0)
        assert not (counted.done() or finished.done() or part.done())
        await box.put({"b": {}})
        assert await counted == (2, 3) and await finished == (2, 3)
        assert await box.take() == {"a": {}, "b": {}} and await box.until(None, 0) == (0, 3)
        await asyncio.sleep(0)
        assert not part.done()
        await box.hand_over(0, [{"id": 1}], [[4]])
        assert await part == ([{"id": 1}], [[4]])
        assert await box.handed_over(0) == ([{"id": 1}], [[4]])  # asked again: at once

    asyncio.run(asyncio.wait_for(scenario(), 5))



@pytest.mark.integration
def test_the_box_and_the_source_load_no_vllm():
    """Their processes start beside an engine that is starting: importing vLLM there would take its CPU."""
    code = ("import sys, json; import moe_cohort.batch.ray_llm.box, moe_cohort.batch.ray_llm.source; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' or m.startswith('ray.llm'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
