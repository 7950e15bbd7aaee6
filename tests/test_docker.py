"""docker/: the Dockerfiles copy what exists (every package of pyproject.toml, nothing .dockerignore drops), run
real `cohort` subcommands with arguments their parsers accept, set only real settings; compose.yaml wires the
proxy to every defined replica. Building and running the images is docker/README.md's (no container runtime in CI)."""

from __future__ import annotations

import fnmatch
import importlib
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from moe_cohort.cli import SUBCOMMANDS, ArgumentParser
from moe_cohort.send.settings import ENV_PREFIX, Settings

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = ("Dockerfile.proxy", "Dockerfile.vllm")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def exec_form(args: str) -> list[str]:
    return json.loads(args) if args.startswith("[") else shlex.split(args)


def cohort_args_ok(argv: list[str]) -> None:
    """`argv` (after `cohort`) names a real subcommand whose parser accepts the arguments (SystemExit otherwise)."""
    assert argv and argv[0] in SUBCOMMANDS, f"`cohort {' '.join(argv)}`: no such subcommand ({sorted(SUBCOMMANDS)})"
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    parser = ArgumentParser(prog=f"cohort {argv[0]}")
    module.add_arguments(parser)
    parser.parse_args(argv[1:])


def dockerignored(path: str) -> bool:
    """Whether the repository's .dockerignore leaves `path` (relative) out of the build context (last match wins)."""
    ignored = False
    for rule in (ROOT / ".dockerignore").read_text().splitlines():
        rule = rule.strip()
        if not rule or rule.startswith("#"):
            continue
        negate, pattern = rule.startswith("!"), rule.lstrip("!")
        parts = Path(path).parts
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern.removeprefix("**/")) for i in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copy_source_exists_in_the_build_context(name):
    copies = [exec_form(args)[:-1] for word, args in instructions(DOCKER / name) if word == "COPY"]
    sources = [s for group in copies for s in group]
    assert sources, f"{name} copies nothing"
    for source in sources:
        assert (ROOT / source).exists(), f"{name}: COPY {source}: no such file in the repository"
        assert not dockerignored(source), f"{name}: COPY {source}: .dockerignore leaves it out of the context"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_images_get_every_package_that_pyproject_installs(name):
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {name.rstrip("*") for name in config["tool"]["setuptools"]["packages"]["find"]["include"]}  # moe_cohort
    copied = {exec_form(args)[0] for word, args in instructions(DOCKER / name) if word == "COPY"}
    assert packages <= copied, f"{name} misses {sorted(packages - copied)} (pip install . would leave them out)"
    assert {"pyproject.toml", "README.md"} <= {s for word, a in instructions(DOCKER / name) if word == "COPY"
                                              for s in exec_form(a)[:-1]}


def test_entry_commands_are_real_cohort_subcommands():
    proxy = dict(instructions(DOCKER / "Dockerfile.proxy"))
    assert exec_form(proxy["ENTRYPOINT"]) == ["cohort"]
    cohort_args_ok(exec_form(proxy["CMD"]))
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    cohort_args_ok(compose["services"]["proxy"]["command"])
    runs = [args for word, args in instructions(DOCKER / "Dockerfile.vllm") if word == "RUN"]
    (tiny,) = [shlex.split(r) for r in runs if r.startswith("cohort ")]
    cohort_args_ok(tiny[1:])
    vllm = dict(instructions(DOCKER / "Dockerfile.vllm"))
    assert exec_form(vllm["ENTRYPOINT"]) == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    cmd = exec_form(vllm["CMD"])
    assert cmd[cmd.index("--model") + 1] == tiny[2]  # serves the model the image made
    assert cmd[cmd.index("--port") + 1] == "8000"


def test_environment_variables_are_real_settings():
    fields = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.__dataclass_fields__}
    env = " ".join(args for word, args in instructions(DOCKER / "Dockerfile.proxy") if word == "ENV")
    named = set(re.findall(r"\b(COHORT_[A-Z_]+)=", env))
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    named |= {k for k in compose["services"]["proxy"]["environment"] if k.startswith(ENV_PREFIX)}
    assert named and named <= fields, f"not settings: {sorted(named - fields)}"


def test_compose_starts_the_proxy_in_front_of_defined_replicas():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    replicas = sorted(name for name in services if name.startswith("vllm-"))
    assert len(replicas) >= 2
    for name in replicas:
        build = services[name]["build"]
        assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == DOCKER / "Dockerfile.vllm"
        assert services[name]["healthcheck"]["test"][0] == "CMD"
    proxy = services["proxy"]
    assert (DOCKER / proxy["build"]["context"] / proxy["build"]["dockerfile"]).resolve() == DOCKER / "Dockerfile.proxy"
    fronted = [re.fullmatch(r"http://([a-z0-9-]+):8000", url) for url in proxy["environment"]["COHORT_BACKENDS"].split(",")]
    assert all(fronted) and sorted(m.group(1) for m in fronted) == replicas  # every replica, each once
    assert Settings(backends=tuple(proxy["environment"]["COHORT_BACKENDS"].split(",")),
                    replica_routing=proxy["environment"]["COHORT_REPLICA_ROUTING"]).replica_routing == "affinity"
    assert sorted(proxy["depends_on"]) == replicas
    assert proxy["ports"] == ["${PROXY_PORT:-8080}:8080"]
    assert all(services[name]["shm_size"] for name in [*replicas, "proxy"])  # vLLM and Ray need /dev/shm
