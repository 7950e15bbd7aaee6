"""What a backend replica says it is: the engine handshake the proxy configures itself from.

A vLLM server with moe-cohort installed describes itself two ways (engine/engine_info.py):

    GET /v1/cohort/info     {"object": "cohort.engine_info", "schema": 1, "max_num_seqs": 16,
                             "moe": {"layers", "experts", "top_k"}, "scheduler": {"expert_aware", ...},
                             "observed_counts": true, ...}        (only where VLLM_PLUGINS names moe_cohort)
    GET /metrics            cohort_engine_info{max_num_seqs="16",expert_aware_scheduler="true",...} 1.0
                                                                  (the general plugin: always loaded)

`ask(client)` tries the route, then the info series, and reads a plain vLLM (or any other OpenAI
server) as knowing nothing. A malformed answer counts as absent, with a warning: a proxy never fails
to start because an engine described itself badly.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Sequence

from prometheus_client.parser import text_string_to_metric_families

from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.errors import BackendStatusError, BackendTimeout, BackendUnreachable, ServiceError

log = logging.getLogger(__name__)

INFO_PATH, INFO_METRIC, SCHEMA = "/v1/cohort/info", "cohort_engine_info", 1
TIMEOUT_S = 2.0  # an engine that does not answer the handshake by then is asked again later
# where the facts came from
ROUTE, METRICS, PLAIN, UNREACHABLE = "info route", "metrics info series", "no moe-cohort plugin", "unreachable"


class MalformedInfo(ValueError):
    """An engine's self-description that does not have the handshake's shape; the message says what is off."""


@dataclass(frozen=True)
class EngineInfo:
    """One replica's answer. Unknown facts are None (a plain vLLM knows none)."""

    source: str  # ROUTE, METRICS, PLAIN or UNREACHABLE
    max_num_seqs: int | None = None
    moe: tuple[int, int, int] | None = None  # (MoE layers, experts per layer, top-k)
    expert_aware: bool = False  # vLLM runs moe_cohort's ExpertAwareScheduler
    observed_counts: bool = False  # POST /v1/cohort/observed is served (learning's source)
    plugin_version: str | None = None
    prefill_ahead: int = 0  # requests our scheduler prefills ahead of decode and admits by their routing (0: none)

    @property
    def plugin(self) -> bool:
        return self.source in (ROUTE, METRICS)


def from_json(body: object) -> EngineInfo:
    """The EngineInfo of GET /v1/cohort/info's JSON; MalformedInfo when it is not the handshake's shape."""
    if not isinstance(body, dict) or body.get("object") != "cohort.engine_info":
        raise MalformedInfo("not an object with \"object\": \"cohort.engine_info\"")
    if body.get("schema") != SCHEMA:
        raise MalformedInfo(f"schema {body.get('schema')!r}, this proxy reads schema {SCHEMA}")
    moe, scheduler = body.get("moe"), body.get("scheduler")
    if moe is not None and not isinstance(moe, dict) or not isinstance(scheduler, dict):
        raise MalformedInfo("\"moe\" must be an object or null and \"scheduler\" an object")
    return EngineInfo(ROUTE, _count(body.get("max_num_seqs"), "max_num_seqs"),
                      None if moe is None else tuple(_count(moe.get(k), f"moe.{k}") for k in ("layers", "experts", "top_k")),
                      _flag(scheduler.get("expert_aware"), "scheduler.expert_aware"),
                      _flag(body.get("observed_counts"), "observed_counts"), str(body.get("plugin_version") or "") or None,
                      _ahead(scheduler.get("prefill_ahead", 0)))


def from_metrics(text: str) -> EngineInfo | None:
    """The EngineInfo of the `cohort_engine_info` series in a /metrics exposition; None when it has none."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise MalformedInfo(f"/metrics does not parse ({exc})") from None
    for family in families:
        for sample in family.samples:
            if sample.name == INFO_METRIC:
                return _from_labels(sample.labels)
    return None


def _from_labels(labels: dict[str, str]) -> EngineInfo:
    if labels.get("schema") != str(SCHEMA):
        raise MalformedInfo(f"{INFO_METRIC} has schema {labels.get('schema')!r}, this proxy reads schema {SCHEMA}")
    moe = None
    if labels.get("experts", "") not in ("", "none"):
        moe = tuple(_count(_int(labels.get(k)), k) for k in ("moe_layers", "experts", "top_k"))
    return EngineInfo(METRICS, _count(_int(labels.get("max_num_seqs")), "max_num_seqs"), moe,
                      labels.get("expert_aware_scheduler") == "true", labels.get("observed_counts") == "true",
                      labels.get("plugin_version") or None, _ahead(_int(labels.get("prefill_ahead", "0"))))


async def ask(client: BackendClient, timeout_s: float = TIMEOUT_S) -> EngineInfo:
    """What the replica behind `client` says it is (see the module docstring), within `timeout_s` (else: UNREACHABLE,
    asked again later); never raises."""
    try:
        return await asyncio.wait_for(_ask(client), timeout_s)
    except TimeoutError:
        return EngineInfo(UNREACHABLE)


async def _ask(client: BackendClient) -> EngineInfo:
    try:
        answer = await client.request("GET", INFO_PATH)
        return from_json(json.loads(answer.content))
    except (BackendUnreachable, BackendTimeout):
        return EngineInfo(UNREACHABLE)
    except (MalformedInfo, ValueError) as exc:
        log.warning("%s%s: ignored, not the engine handshake (%s)", client.base_url, INFO_PATH, exc)
    except ServiceError as exc:  # 404: the endpoint plugin is not loaded; try the info series
        if not isinstance(exc, BackendStatusError):
            return EngineInfo(UNREACHABLE)
    return await _ask_metrics(client)


async def _ask_metrics(client: BackendClient) -> EngineInfo:
    try:
        answer = await client.request("GET", "/metrics")
        return from_metrics(answer.text) or EngineInfo(PLAIN)
    except (BackendUnreachable, BackendTimeout):
        return EngineInfo(UNREACHABLE)
    except MalformedInfo as exc:
        log.warning("%s/metrics: %s; read as a vLLM without the moe-cohort plugin", client.base_url, exc)
    except ServiceError:
        pass
    return EngineInfo(PLAIN)


async def ask_all(urls: Sequence[str], settings) -> list[EngineInfo]:
    """What each replica at `urls` says it is (`ask`, at once), through clients of `settings` (send.settings)."""
    clients = [BackendClient(url, timeout_s=TIMEOUT_S, connect_timeout_s=settings.connect_timeout_s,
                             api_key=settings.backend_api_key) for url in urls]
    try:
        return list(await asyncio.gather(*(ask(client) for client in clients)))
    finally:
        await asyncio.gather(*(client.close() for client in clients))


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MalformedInfo(f"{name} must be a positive integer, got {value!r}")
    return value


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise MalformedInfo(f"{name} must be true or false, got {value!r}")
    return value


def _ahead(value: object) -> int:
    """scheduler.prefill_ahead: a whole number >= 0 (an engine of an older plugin does not say it: 0)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedInfo(f"scheduler.prefill_ahead must be a whole number >= 0, got {value!r}")
    return value
