"""Layering: the floors of docs/design.md and the purity of the algorithm modules, from the code's imports.

Every `import` statement of our packages is read from the source (module level or inside a
function, so lazy imports count too). Our packages live in one namespace, `moe_cohort/`: floors:
traces/, admission/ and encoder/ are the ground (they import no other package of ours), engine/,
train/ and eval/ stand on them, devtools/ on those, send/ (the send path) above, batch/, embedded/ and
ray_serve/ on it, proxy/ (whose Batch API runs the batch runner) above them, and the `cohort` command
(moe_cohort/cli/__init__.py, moe_cohort/__init__.py) above all; a package imports only packages on lower
floors. The pure modules (traces/, admission/, encoder/, eval/, train/, engine/selection/) import
no web framework, no HTTP client and no vLLM, and import each other in no circle. Nothing imports
one of our packages by a bare name (`import proxy`): installed, only `moe_cohort` exists.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NS = "moe_cohort"
FLOORS = {"traces": 0, "admission": 0, "encoder": 0, "engine": 1, "train": 1, "eval": 1, "devtools": 2, "send": 3,
          "batch": 4, "embedded": 4, "ray_serve": 4, "proxy": 5, "cohort": 6}
PURE = tuple(f"{NS}.{p}" for p in ("traces", "admission", "encoder", "eval", "train", "engine.selection"))
FORBIDDEN_IN_PURE = ("vllm", "fastapi", "starlette", "uvicorn", "aiohttp", "httpx", "requests", "urllib3", "flask",
                     "urllib.request", "http.client", "http.server")
HEAVY = ["torch", "sentence_transformers", "transformers", "vllm", "httpx", "fastapi", "starlette", "aiohttp", "requests"]


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of our packages: dotted name (moe_cohort.proxy.app) -> file (moe_cohort/proxy/app.py)."""
    found = {}
    for path in sorted((root / NS).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def package_of(name: str) -> str | None:
    """The floor key of a module name: moe_cohort.proxy.app -> proxy, moe_cohort.cli -> cohort; None if not ours."""
    parts = name.split(".")
    if parts[0] != NS:
        return None
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else "cohort"


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules `path` imports; `from a import b` names a.b when that is one of `known`, else a."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            names.update(submodules)
            if len(submodules) < len(node.names):  # some names are attributes of the module itself
                names.add(node.module)
    return names


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def floor_breaches(known: dict[str, Path]) -> list[str]:
    """'a.b -> c.d' for every import of a package on the same or a higher floor than the importer's."""
    out = []
    for name, path in known.items():
        own = package_of(name)
        for target in imports(path, known):
            other = package_of(target)
            if other is not None and other != own and FLOORS[other] >= FLOORS[own]:
                out.append(f"{name} -> {target}")
    return sorted(out)


def bare_imports(known: dict[str, Path], tests: Path = ROOT / "tests") -> list[str]:
    """'file -> name' for every import of one of our folders by its bare name, in the packages and the tests."""
    files = [*known.values(), *sorted(tests.rglob("*.py"))]
    out = []
    for path in files:
        for target in imports(path, known):
            if target.split(".")[0] in FLOORS:
                out.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} -> {target}")
    return sorted(out)


def impure_imports(known: dict[str, Path]) -> list[str]:
    """'module -> import' for every web framework, HTTP client or vLLM import of a pure module."""
    out = []
    for name, path in known.items():
        if any(_within(name, p) for p in PURE):
            out += [f"{name} -> {t}" for t in imports(path, known) if any(_within(t, f) for f in FORBIDDEN_IN_PURE)]
    return sorted(out)


def circles(known: dict[str, Path], scope: tuple[str, ...]) -> list[list[str]]:
    """Import circles among the modules under `scope` (strongly connected components, Tarjan)."""
    nodes = [n for n in known if any(_within(n, p) for p in scope)]
    edges = {n: sorted(t for t in imports(known[n], known) if t in nodes and t != n) for n in nodes}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(n: str) -> None:
        index[n] = low[n] = len(index)
        stack.append(n)
        on_stack.add(n)
        for m in edges[n]:
            if m not in index:
                visit(m)
                low[n] = min(low[n], low[m])
            elif m in on_stack:
                low[n] = min(low[n], index[m])
        if low[n] == index[n]:
            component = []
            while not component or component[-1] != n:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for n in nodes:
        if n not in index:
            visit(n)
    return found


@pytest.fixture(scope="module")
def known() -> dict[str, Path]:
    return modules()


def test_every_package_imports_only_lower_floors(known):
    assert {"moe_cohort.traces.format", "moe_cohort.encoder.planner", "moe_cohort.engine.selection", "moe_cohort.embedded.vllm_server", "moe_cohort.proxy.app"} <= known.keys()
    assert floor_breaches(known) == []


def test_our_packages_are_imported_through_the_namespace_only(known):
    assert bare_imports(known) == []


def test_pure_modules_import_no_web_framework_http_client_or_vllm(known):
    assert impure_imports(known) == []


def test_pure_modules_import_each_other_in_no_circle(known):
    assert circles(known, PURE) == []


def _package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (root / NS / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / NS / rel).write_text(text)
    return modules(root)


def test_the_checks_see_a_forbidden_import_once_added(tmp_path):
    """Each rule goes red on one bad import, lazy ones included."""
    known = _package(tmp_path, {
        "traces/__init__.py": "", "traces/format.py": "def load():\n    from moe_cohort.eval import report\n",
        "eval/__init__.py": "", "eval/report.py": "import numpy\n",
        "encoder/__init__.py": "", "encoder/a.py": "from moe_cohort.encoder import b\n",
        "encoder/b.py": "import moe_cohort.encoder.a\n",
        "engine/selection/__init__.py": "", "engine/selection/x.py": "from vllm.model_executor import layers\n",
        "proxy/__init__.py": "", "proxy/app.py": "from engine.selection import x\n"})
    assert floor_breaches(known) == ["moe_cohort.traces.format -> moe_cohort.eval.report"]
    assert impure_imports(known) == ["moe_cohort.engine.selection.x -> vllm.model_executor"]
    assert circles(known, PURE) == [["moe_cohort.encoder.a", "moe_cohort.encoder.b"]]
    assert bare_imports(known, tmp_path / "tests") == [f"{tmp_path / NS / 'proxy/app.py'} -> engine.selection"]


@pytest.mark.integration
def test_planner_modules_stay_pure():
    """Planning needs numpy and FAISS only: no torch, no web framework, no HTTP client, no vLLM (at run time,
    imports of imports included)."""
    code = ("import sys, json; import moe_cohort.encoder, moe_cohort.encoder.planner, "
            "moe_cohort.encoder.inputs, moe_cohort.encoder.text, moe_cohort.cli.plan; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in %r)))" % (HEAVY,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


@pytest.mark.integration
def test_the_built_wheel_installs_one_top_level_name(tmp_path):
    """A wheel of this checkout puts `moe_cohort` (and its dist-info) in site-packages, no generic name beside it."""
    import shutil
    import zipfile

    src = tmp_path / "src"  # pip builds in the source tree (build/, *.egg-info): a copy keeps the checkout clean
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / NS, src / NS, ignore=shutil.ignore_patterns("__pycache__"))
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(tmp_path), str(src)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("moe_cohort-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {NS}
    assert {f"{NS}/cli/__init__.py", f"{NS}/admission/waiting.py", f"{NS}/batch/core.py", f"{NS}/engine/selection/__init__.py"} <= set(names)
