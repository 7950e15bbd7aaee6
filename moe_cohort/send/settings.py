"""The proxy's one settings object: its fields, sections, defaults, meanings and the checks of their values.

It is built once per process from CLI flags, `COHORT_*` variables and a config file
(send/setting_sources.py: `load_settings`). A bad value is a SettingsError naming the setting.

Every setting has one name, whichever way it is set: the field (the config file's key), `COHORT_<FIELD>` (its
variable, `variable_of`) and, where a command takes it, one flag (`flag_of`: the field's name, unless the field
says otherwise). A command's flags are the few settings a user sets there (cli/setting_flags.py); every setting
is a variable and a config key, listed with its meaning in docs/configuration.md, made from this module.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from moe_cohort.admission.fairness import MAX_WAIT_S

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
    return SettingsError(f"{name} (env {variable_of(name)}) {detail}", field=name, detail=detail)


# The sections of the settings, in the order `cohort serve --help` and docs/configuration.md show them: name ->
# (what the section sets, its fields). Every field is in exactly one section.
SECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "backend": ("the vLLM server(s) the proxy fronts",
                ("backends", "replica_routing", "model_dir", "backend_api_key", "request_timeout_s", "connect_timeout_s",
                 "backend_wait_s", "backend_port")),
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
                ("data_dir", "max_file_bytes", "batch_max_in_flight", "batch_max_retries", "batch_probe")),
}
# Settings that vLLM's process reads too (moe-cohort's plugin and scheduler), under the same variable: one
# environment configures the proxy and the engine alike.
ENGINE_READS = ("default_policy", "max_queue_ms", "max_passed")
# encoder name or path: "static" (a model2vec distillation of the packaged MiniLM, built once, far faster and as
# good a plan without a profile head), "" = the packaged all-MiniLM-L6-v2, "none" = no prediction, first come first
# served; every command that embeds prompts defaults to it
DEFAULT_ENCODER = "static"
# `--learn`: where the head it learns comes from, and what admission reads before its first
LEARN_MEANING = ("learn the profile head online from the engine's routing of answered requests: the expert counts "
                 "that moe-cohort's vLLM plugin serves (VLLM_PLUGINS=moe_cohort), or vLLM's routed_experts in "
                 "non-streamed answers (a vLLM started with --enable-return-routed-experts); it starts from what "
                 "earlier runs learned, kept in data_dir/learned, and until its first head admission reads the head "
                 "of an encoder folder from `cohort train` (fitted on recorded traces), if it has one (default: on "
                 "when a replica serves its expert counts)")


def _setting(default, meaning: str, *, flag: str | None = None, many: bool = False):
    """A Settings field: its default, what it sets (the help of its flag and its line in docs/configuration.md),
    its flag where it is not the field's name (`--backend` for backends), and `many`: a text setting that
    takes several values, the flag repeated or a comma list."""
    return dataclasses.field(default=default, metadata={"meaning": meaning, "flag": flag, "many": many})


@dataclass(frozen=True)
class Settings:
    # -- backend
    backends: tuple[str, ...] = _setting((), "vLLM servers to front, e.g. http://127.0.0.1:8000; several replicas: "
                                             "the flag repeated, or a comma list, each with max_in_flight slots "
                                             "(default: start a tiny one)", flag="--backend")
    replica_routing: str = _setting("affinity", "which replica takes which request: affinity (a freed slot takes the "
                                        "request that best fits that replica's residents), least-loaded or "
                                        "round-robin")
    model_dir: str = _setting("", "without a backend: the model folder the embedded vLLM serves as it is; without a "
                                  "model there, the tiny MoE is trained on text into it once (default: "
                                  "trained-tiny-moe-model in $COHORT_CACHE_DIR, else $XDG_CACHE_HOME/moe-cohort or "
                                  "~/.cache/moe-cohort)")
    backend_api_key: str = _setting("", "key sent to the backend (default: the client's, where the proxy has no "
                                        "keys)")
    request_timeout_s: float = _setting(600.0, "seconds a backend request may take")
    connect_timeout_s: float = _setting(5.0, "seconds to connect to the backend")
    backend_wait_s: float = _setting(30.0, "with a backend: seconds `cohort serve` asks each replica's /health at "
                                           "start-up, with backoff, before it starts anyway (requests get 502 "
                                           "until the replica answers); 0: no check")
    backend_port: int = _setting(0, "without a backend: port of the embedded vLLM (0: a free port)")
    # -- server
    host: str = _setting("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = _setting(8080, "port to listen on")
    max_body_bytes: int = _setting(10 * 1024 * 1024, "largest request body, and longest line of a batch file")
    max_header_bytes: int = _setting(64 * 1024, "largest request head (its target and headers together); over it: "
                                                "431")
    max_headers: int = _setting(100, "most headers a request may have; over it: 431")
    head_timeout_s: float = _setting(10.0, "seconds a connection has to send a request's whole head, from its "
                                           "opening or the end of the last answer; then it is closed")
    keepalive_s: float = _setting(10.0, "seconds between the SSE comments sent while a streaming request waits")
    access_log: bool = _setting(True, "one access log line per request (method, path, status, ms, request id)")
    log_prompts: bool = _setting(False, "log prompt texts (off: they are user data)")
    # -- access
    api_keys: tuple[str, ...] = _setting((), "keys clients must send as `Authorization: Bearer`; KEY=TENANT groups "
                                             "keys by tenant, each owning its files and batches; the flag repeated "
                                             "or a comma list (default: none, the proxy is open)", flag="--api-key")
    protect_metrics: bool = _setting(False, "/metrics needs a key, and /health shows a caller without one only its "
                                            "status (needs api_keys)")
    api_docs: bool = _setting(False, "serve /openapi.json, /docs and /redoc, behind the keys like every route "
                                     "(/docs and /redoc load their JavaScript from a CDN)")
    trust_client_hints: bool = _setting(False, "forward what clients send in vllm_xargs.moe_profile and moe_record "
                                               "(trusted callers only: a client's profile can put it first in the "
                                               "engine's queue, moe_record writes its prompt to the engine's disk); "
                                               "off: they are dropped")
    allowed_policies: tuple[str, ...] = _setting((), "routing policies clients may ask for (X-MoE-Routing, "
                                                     "vllm_xargs.moe_routing): names such as oea (any parameters) or "
                                                     "policies such as 'xshare;m=24', a comma list (default: any)",
                                                 flag="--allowed-policy")
    # -- admission
    max_in_flight: int = _setting(0, "requests at each replica at once (default: from its vLLM: its max_num_seqs, "
                                     "more where vLLM runs moe-cohort's scheduler, 256 where it does not say; the "
                                     "embedded vLLM: 16)")
    max_queue_ms: float = _setting(MAX_WAIT_S * 1000, "fairness bound: a request that has waited this long is admitted "
                                             "first (vLLM's scheduler reads it too; `cohort replay` counts it in "
                                             "engine steps: --max-queue-steps)")
    max_passed: int = _setting(0, "fairness bound: a request that this many later arrivals were admitted before "
                                  "goes first (default: 3 x the slots of the smallest replica the proxy admits for; "
                                  "vLLM's scheduler: 3 x its max_num_seqs)")
    default_policy: str = _setting("topk", "routing policy of a request that names none (no X-MoE-Routing header, "
                                           "no vllm_xargs.moe_routing); vLLM's plugin reads it too")
    forward_profiles: bool | None = _setting(None, "every request waits for its prediction (profile_deadline_ms at "
                                                   "most) and carries it: vllm_xargs.moe_profile for a vLLM running "
                                                   "moe-cohort's expert-aware scheduler, x-cohort-key for a router "
                                                   "such as llm-d's; off: a request that finds a free slot goes at "
                                                   "once, without them (default: on for each replica whose vLLM runs "
                                                   "that scheduler, which then admits)")
    profile_deadline_ms: float = _setting(0.0, "longest wait for a request's predicted profile; past it the request "
                                               "goes on without one, first come, first served (default: 50 for a "
                                               "static encoder, 500 for a transformer)")
    # -- encoder
    encoder: str = _setting(DEFAULT_ENCODER, "predicts each request's experts from its text: 'static' (distilled "
                                             "from the packaged MiniLM once, then cached), 'all-MiniLM-L6-v2' (the "
                                             "packaged MiniLM), a `cohort train` folder (with its profile head), "
                                             "onnx or onnx:FOLDER (int8), a hub name; 'none': no prediction, first "
                                             "come, first served")
    encoder_max_seq_len: int = _setting(128, "tokens of a text the encoder reads (the rest is cut)",
                                        flag="--max-seq-len")
    encoder_cache: int = _setting(10_000, "embeddings kept by text hash, so that a repeated prompt is not embedded "
                                          "again; 0: none")
    encoder_threads: int = _setting(1, "CPU threads the encoder and profile head may use (torch, BLAS, the "
                                       "tokenizer); 1 keeps them beside the event loop on one core, off the "
                                       "engine's cores")
    # -- learning
    learn: bool | None = _setting(None, LEARN_MEANING)
    learn_sample_rate: float = _setting(0.05, "share of the requests the reservoir does not keep that are observed "
                                              "anyway, for the live fit (the reservoir keeps every request until it "
                                              "is full, then capacity / seen of them)")
    learn_capacity: int = _setting(1000, "observations kept, a uniform sample of all seen (in data_dir/learned)")
    learn_refit_every: int = _setting(50, "new observations between refits, at least (and a quarter of the last "
                                          "fit's; `cohort batch run`: 16 unless set)")
    # -- batches: `cohort batch run` and the Batch API
    data_dir: str = _setting("", "Batch API storage (uploaded files, results, SQLite records) and the learned head "
                                 "(learned/) (default: $XDG_DATA_HOME/moe-cohort or ~/.local/share/moe-cohort)")
    max_file_bytes: int = _setting(200 * 1024 * 1024, "largest file uploaded to /v1/files (Batch API input)")
    batch_max_in_flight: int = _setting(0, "the Batch API's requests at each replica at once, within the slots online "
                                         "requests leave free (default: max_in_flight, else the replica's "
                                         "max_num_seqs plus a queue as deep); `cohort batch run` has the replicas to "
                                         "itself: max_in_flight")
    batch_max_retries: int = _setting(5, "retries per batch request for 429, 5xx and timeouts (exponential "
                                         "backoff)", flag="--max-retries")
    batch_probe: bool | None = _setting(None, "`cohort batch run`: route each line's prompt through the engine once "
                                              "before its turn (a one-token request whose expert counts moe-cohort's "
                                              "vLLM plugin hands back) and order the lines by that routing (default: "
                                              "on where the backend serves its expert counts and --encoder is not "
                                              "none)", flag="--probe")

    def __post_init__(self) -> None:
        from moe_cohort.engine.policy import PolicyError, parse_policy
        from moe_cohort.send.auth import KeyListError, key_owners

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
        bad_urls = [u for u in self.backends if not _is_http_url(u)]
        if bad_urls:
            raise _bad("backends", f"must be http:// or https:// URLs such as http://127.0.0.1:8000 "
                                   f"(replicas: comma-separated), got {bad_urls[0]!r}")
        from moe_cohort.send.hints import canonical_policies

        try:  # canonical, once: "XShare; m=24" is matched as "xshare;m=24"
            object.__setattr__(self, "allowed_policies", canonical_policies(self.allowed_policies))
        except PolicyError as exc:
            raise _bad("allowed_policies", f"must be policy names or policies: {exc}") from None
        from moe_cohort.admission.router import ROUTINGS

        if self.replica_routing not in ROUTINGS:
            raise _bad("replica_routing", f"must be one of {', '.join(ROUTINGS)}, got {self.replica_routing!r}")
        if not 1 <= self.port <= 65535:
            raise _bad("port", f"must be a TCP port in 1..65535, got {self.port}")
        if not 0 <= self.backend_port <= 65535:
            raise _bad("backend_port", f"must be a TCP port in 1..65535, or 0 for a free one, got {self.backend_port}")
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
                     "backend_wait_s", "encoder_cache", "batch_max_in_flight", "batch_max_retries"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):  # nan fails too
                raise _bad(name, f"must be a finite number >= 0, got {value}")

    @property
    def max_in_flight_for_batches(self) -> int:
        """Batch requests at the backend at once: batch_max_in_flight, else max_in_flight, else vLLM's default 256."""
        return self.batch_max_in_flight or self.max_in_flight or 256

    @property
    def data_path(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "moe-cohort"

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)


def flag_of(name: str) -> str:
    """The one flag of the setting `name` in every command that takes it: `--` and the field's name with dashes,
    unless the field names another (`--backend` for backends)."""
    return Settings.__dataclass_fields__[name].metadata["flag"] or "--" + name.replace("_", "-")


def variable_of(name: str) -> str:
    """The setting's variable: COHORT_ and the field's name upper-cased."""
    return f"{ENV_PREFIX}{name.upper()}"


def meaning_of(name: str) -> str:
    """What the setting sets, in one text: its flag's help and its line in the config reference."""
    return Settings.__dataclass_fields__[name].metadata["meaning"]


# A CLI's flag table: flag -> (Settings field, type, help). Defaults stay in Settings and COHORT_*.
FlagTable = dict[str, tuple[str, type, str]]
