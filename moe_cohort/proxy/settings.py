"""The proxy's one settings object: its fields, sections, defaults and the checks of their values.

It is built once per process from CLI flags, `COHORT_*` variables and a config file
(proxy/setting_sources.py: `load_settings`). A bad value is a SettingsError naming the setting.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

ENV_PREFIX = "COHORT_"


class SettingsError(ValueError):
    """A setting has a value of the wrong type or range; the message names it (`field`: the Settings field)."""

    def __init__(self, message: str, *, field: str | None = None, detail: str = "") -> None:
        super().__init__(message)
        self.field, self.detail = field, detail


def _is_http_url(text: str) -> bool:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # raises ValueError for a port that is not a number in range
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _bad(name: str, detail: str) -> SettingsError:
    return SettingsError(f"{name} (env {ENV_PREFIX}{name.upper()}) {detail}", field=name, detail=detail)


# The sections of the settings, in the order `cohort serve --help` shows them: name -> (what the section
# sets, its fields). Every field is in exactly one section.
SECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "backend": ("the vLLM server(s) the proxy fronts",
                ("backend_url", "routing", "backend_api_key", "request_timeout_s", "connect_timeout_s")),
    "server": ("where the proxy listens and what it accepts",
               ("host", "port", "max_body_bytes", "max_header_bytes", "max_headers", "head_timeout_s", "keepalive_s",
                "access_log", "log_prompts")),
    "access": ("who may call the proxy and what clients may ask of the engine",
               ("api_keys", "protect_metrics", "api_docs", "trust_client_hints", "allowed_policies")),
    "admission": ("which waiting request goes to the engine next",
                  ("max_in_flight", "max_queue_ms", "max_passed", "default_policy", "forward_profiles",
                   "profile_deadline_ms")),
    "encoder": ("the model that predicts each request's experts from its text",
                ("encoder", "encoder_max_seq_len", "encoder_cache", "encoder_threads")),
    "learning": ("learning the profile head from the engine's routing of answered requests",
                 ("learn", "learn_sample_rate", "learn_capacity", "learn_refit_every")),
    "batches": ("the Batch API and `cohort batch run`",
                ("data_dir", "max_file_bytes", "batch_concurrency", "batch_max_retries")),
}
# encoder name or path: "static" (a model2vec distillation of the packaged MiniLM, built once, far faster and as
# good a plan without a profile head), "" = the packaged all-MiniLM-L6-v2, "none" = no prediction, first come first
# served; every command that embeds prompts defaults to it
DEFAULT_ENCODER = "static"


@dataclass(frozen=True)
class Settings:
    # -- backend
    # vLLM server(s) to front, e.g. http://127.0.0.1:8000; several replicas as a comma list, each with
    # max_in_flight slots (empty: start the embedded one)
    backend_url: str = ""
    routing: str = "affinity"  # which replica takes which request: affinity | least-loaded | round-robin
    backend_api_key: str = ""  # key sent to the backend; empty = forward the client's (when the proxy has no keys)
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    # -- server
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 10 * 1024 * 1024  # largest request body, and largest line of a batch file
    # a request's head: its target and headers together, and how many headers; over either: 431 while the
    # head is read (proxy/http/limits.py)
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    # how long a connection may take to send a request's whole head, from its opening or the end of the last
    # answer; then it is closed (slow or idle clients holding connections: proxy/http/limits.py)
    head_timeout_s: float = 10.0
    keepalive_s: float = 10.0  # SSE comment interval while a streaming request is queued
    access_log: bool = True  # one `moe_cohort.proxy.access` log line per request (method, path, status, ms, request id)
    log_prompts: bool = False  # prompts are user data: never logged unless asked for
    # -- access
    api_keys: tuple[str, ...] = ()  # proxy keys clients must send as `Authorization: Bearer`; empty = open
    protect_metrics: bool = False  # /metrics needs a key, /health without one says only its status (needs api_keys)
    # /openapi.json, /docs, /redoc (proxy/http/api_docs.py): off; on, behind the key like every route (/docs and /redoc
    # load their JavaScript from a CDN)
    api_docs: bool = False
    # engine hints (proxy/hints.py): clients' vllm_xargs.moe_profile and moe_record are dropped unless trusted (a
    # gateway that predicts profiles itself); moe_routing is theirs, within allowed_policies (names such as
    # "topk,oea" allow any parameters, or exact policies "xshare;m=24"; empty: any policy)
    trust_client_hints: bool = False
    allowed_policies: tuple[str, ...] = ()
    # -- admission
    # requests at each replica at once; 0: from the replica's handshake (proxy/autoconfig.py: its max_num_seqs, or
    # more where vLLM admits by itself)
    max_in_flight: int = 0
    max_queue_ms: float = 30_000.0  # fairness bound: a request that has waited this long is admitted first
    # fairness bound in admissions: a request that this many later arrivals were admitted before goes first
    # (admission.waiting); 0: 3 x the slots of the smallest replica admitting in the proxy (proxy/autoconfig.py)
    max_passed: int = 0
    default_policy: str = "topk"  # routing policy when a request has no X-MoE-Routing header
    # every request waits for its prediction (at most profile_deadline_ms) and carries it: vllm_xargs.moe_profile
    # for an engine running engine.scheduler.ExpertAwareScheduler, x-cohort-key for a router (llm-d); off: a
    # request that finds a free slot goes at once, without them; None: per replica, on where its vLLM runs our scheduler
    forward_profiles: bool | None = None
    # longest wait for a request's predicted profile; past it the request goes on without one (first come, first
    # served); 0: by the encoder, 50 for a static one, 500 for a transformer (proxy/profiles.py)
    profile_deadline_ms: float = 0.0
    # -- encoder
    encoder: str = DEFAULT_ENCODER
    encoder_max_seq_len: int = 128
    encoder_cache: int = 10_000  # embeddings kept by text hash (repeated prompts are not embedded again); 0: off
    # CPU threads `cohort serve`'s encoder and profile head may use (torch, BLAS, the tokenizer): 1 keeps
    # them beside the event loop on one core, off the engine's cores and out of each other's way
    encoder_threads: int = 1
    # -- learning
    # online learning of the profile head from the served model's routing (proxy/learning.py); None: on when a
    # replica serves its expert counts (proxy/autoconfig.py)
    learn: bool | None = None
    learn_sample_rate: float = 0.05  # share of the requests the reservoir does not keep observed anyway (live fit)
    learn_capacity: int = 1000  # observations kept (a uniform sample of all), in --data-dir/learned
    learn_refit_every: int = 50  # new observations between refits, at least (and a quarter of the last fit's)
    # -- batches: `cohort batch run` and the Batch API (proxy/batch/run.py)
    data_dir: str = ""  # Batch API files + SQLite records ("" = $XDG_DATA_HOME/moe-cohort, else ~/.local/share/moe-cohort)
    max_file_bytes: int = 200 * 1024 * 1024  # largest uploaded batch file (OpenAI's limit)
    # batch requests at the backend at once (0: = max_in_flight, the backend's capacity); Batch API
    # jobs also take only slots of max_in_flight that online requests leave free
    batch_concurrency: int = 0
    batch_max_retries: int = 5  # retries per batch request for 429, 5xx and timeouts (exponential backoff)

    def __post_init__(self) -> None:
        from moe_cohort.engine.policy import PolicyError, parse_policy
        from moe_cohort.proxy.auth import KeyListError, key_owners

        try:
            key_owners(self.api_keys)  # an empty key, or one key for two tenants
        except KeyListError as exc:
            raise _bad("api_keys", str(exc)) from None
        if self.protect_metrics and not self.api_keys:
            raise _bad("protect_metrics", "needs at least one --api-key (COHORT_API_KEYS): without keys "
                                          "nothing protects /metrics")

        try:
            parse_policy(self.default_policy)
        except PolicyError as exc:
            raise _bad("default_policy", f"{self.default_policy!r}: {exc}") from None
        bad_urls = [u for u in self.backend_url.split(",") if not _is_http_url(u.strip())]  # replicas: comma-separated
        if self.backend_url.strip() and bad_urls:
            raise _bad("backend_url", f"must be an http:// or https:// URL such as http://127.0.0.1:8000 "
                                      f"(replicas: comma-separated), got {bad_urls[0]!r}")
        from moe_cohort.proxy.hints import canonical_policies

        try:  # canonical, once: "XShare; m=24" is matched as "xshare;m=24"
            object.__setattr__(self, "allowed_policies", canonical_policies(self.allowed_policies))
        except PolicyError as exc:
            raise _bad("allowed_policies", f"must be policy names or policies: {exc}") from None
        from moe_cohort.admission.router import ROUTINGS

        if self.routing not in ROUTINGS:
            raise _bad("routing", f"must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if not 1 <= self.port <= 65535:
            raise _bad("port", f"must be a TCP port in 1..65535, got {self.port}")
        if self.max_passed < 0:
            raise _bad("max_passed", f"must be >= 1, or 0 for 3 x the replica's slots, got {self.max_passed}")
        if self.max_in_flight < 0:
            raise _bad("max_in_flight", f"must be >= 1, or 0 for each replica's max_num_seqs, got {self.max_in_flight}")
        for name in ("max_body_bytes", "encoder_max_seq_len", "max_file_bytes", "encoder_threads",
                     "max_header_bytes", "max_headers"):
            if getattr(self, name) < 1:
                raise _bad(name, f"must be >= 1, got {getattr(self, name)}")
        if self.learn is True and self.encoder.lower() == "none":
            raise _bad("learn", "needs an encoder (the head it learns reads the prompt's embedding); drop --encoder none")
        if not 0 <= self.learn_sample_rate <= 1:
            raise _bad("learn_sample_rate", f"must be a share in [0, 1], got {self.learn_sample_rate}")
        if self.learn_capacity < 16 or self.learn_refit_every < 1:
            raise _bad("learn_capacity" if self.learn_capacity < 16 else "learn_refit_every",
                       f"need learn_capacity >= 16 (the first head is fitted on 16) and learn_refit_every >= 1, got "
                       f"{self.learn_capacity} and {self.learn_refit_every}")
        if not 0 < self.head_timeout_s < float("inf"):
            raise _bad("head_timeout_s", f"must be a finite number > 0, got {self.head_timeout_s}")
        for name in ("max_queue_ms", "keepalive_s", "profile_deadline_ms", "request_timeout_s", "connect_timeout_s",
                     "encoder_cache",
                     "batch_concurrency", "batch_max_retries"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):  # nan fails too
                raise _bad(name, f"must be a finite number >= 0, got {value}")

    @property
    def backend_urls(self) -> tuple[str, ...]:
        """The backend replicas: `backend_url` split at commas (one URL: one replica; empty: none)."""
        return tuple(u.strip() for u in self.backend_url.split(",") if u.strip())

    @property
    def batch_in_flight(self) -> int:
        """Batch requests at the backend at once: batch_concurrency, else max_in_flight, else vLLM's default 256."""
        return self.batch_concurrency or self.max_in_flight or 256

    @property
    def data_path(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "moe-cohort"

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)


# A CLI's flag table: flag -> (Settings field, type, help). Defaults stay in Settings and COHORT_*.
FlagTable = dict[str, tuple[str, type, str]]
