"""The routing-policy grammar: `NAME[;key=value]*`, e.g. `xshare;m=24;k0=1` or `topk`.

The proxy reads a policy per request (a header value) and the engine plugin applies it, so this
module is pure Python: it must import without torch. Every policy is a frozen dataclass whose
fields are the typed parameters; `parse_policy` validates names, types and ranges and
`format_policy` (also `str(policy)`) writes the canonical form back, so that
`parse_policy(str(p)) == p`. The canonical form is the name followed by every parameter that is set,
in the order of the dataclass fields.

Limits that depend on the model (`k0 <= top_k`, `max_p <= num_experts`) are checked by
`Policy.validate_for_model`, which the plugin calls when a request arrives, so that a bad header is
rejected before it reaches the model's forward pass.

`Policy.decode_only` follows each paper's setting: Lynx (both variants) and OEA route decode
batches only, MoE-Spec and XShare's speculative variant budget the verification (decode) pass;
plain XShare (Alg. 1-2) and its expert-parallel variant (Alg. 5-6) are stated for any batch and
apply in prefill too. A decode-only policy routes prefill batches with plain top-k.

The algorithms behind the names live in `engine.selection`; see each selector's docstring.
One module on purpose, though long: the grammar is one table of policy dataclasses (fields, ranges, model
checks) that the proxy and the plugin share; split, a policy's rules would live in two places.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "POLICY_NAMES", "Policy", "PolicyError", "TopK", "XShare", "XShareSpec", "XShareEP", "OEA",
    "LynxLat", "LynxAcc", "MoESpec", "format_policy", "parse_policy",
]

ENV_POLICY = "COHORT_DEFAULT_POLICY"  # the engine's default policy for requests that name none (the proxy's too)
_INT = re.compile(r"[+-]?\d+\Z")


class PolicyError(ValueError):
    """A policy string or value is invalid; `key` names the offending key (None: the name or form)."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# ---- value specs: parse text, check a value, say what is allowed ---------------------------------

@dataclass(frozen=True)
class _Int:
    low: int
    high: int | None = None

    def parse(self, text: str) -> int:
        if not _INT.match(text):
            raise ValueError(text)
        return int(text)

    def ok(self, value: Any) -> bool:
        in_range = self.high is None or value <= self.high
        return isinstance(value, int) and not isinstance(value, bool) and value >= self.low and in_range

    def allowed(self) -> str:
        return f"an integer >= {self.low}" if self.high is None else f"an integer in {self.low}..{self.high}"

    def format(self, value: int) -> str:
        return str(value)


@dataclass(frozen=True)
class _Float:
    low: float
    high: float
    low_open: bool = False

    def parse(self, text: str) -> float:
        return float(text)

    def ok(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def allowed(self) -> str:
        if math.isinf(self.high):  # ok() takes finite numbers only: no "(0, inf]" that rejects inf
            return f"a finite number {'>' if self.low_open else '>='} {self.low:g}"
        bracket = "(" if self.low_open else "["
        return f"a number in {bracket}{self.low:g}, {self.high:g}]"

    def format(self, value: float) -> str:
        return repr(float(value))


@dataclass(frozen=True)
class _Choice:
    choices: tuple[str, ...]

    def parse(self, text: str) -> str:
        return text

    def ok(self, value: Any) -> bool:
        return value in self.choices

    def allowed(self) -> str:
        return "one of " + ", ".join(self.choices)

    def format(self, value: str) -> str:
        return value


@dataclass(frozen=True)
class _Path:
    def parse(self, text: str) -> str:
        return text

    def ok(self, value: Any) -> bool:
        return isinstance(value, str) and bool(value.strip()) and ";" not in value and value == value.strip()

    def allowed(self) -> str:
        return "a file path without ';' or surrounding spaces"

    def format(self, value: str) -> str:
        return value


def _param(spec: Any, default: Any = None) -> Any:
    return field(default=default, metadata={"spec": spec})


# ---- the policies ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Policy:
    """Base of every policy: a name (class attribute) and typed, validated parameters (fields)."""

    name: ClassVar[str] = ""
    _decode_only: ClassVar[bool] = False

    @property
    def decode_only(self) -> bool:
        """True when the policy leaves prefill batches unchanged (plain top-k there)."""
        return self._decode_only

    def effective(self, is_prefill: bool) -> "Policy":
        """The policy that routes a batch in this phase: `TopK()` for a decode-only policy in
        prefill, else itself. The one place where `decode_only` is resolved."""
        return TopK() if is_prefill and self._decode_only else self

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, spec = getattr(self, f.name), f.metadata["spec"]
            if value is not None and not spec.ok(value):
                raise PolicyError(
                    f"{self.name}: key '{f.name}' must be {spec.allowed()}, got {value!r}", key=f.name)
        self._check()

    def _check(self) -> None:
        """Cross-field rules of one policy; raise PolicyError."""

    def validate_for_model(self, top_k: int, num_experts: int) -> None:
        """Raise PolicyError if the parameters do not fit a model with this top_k and expert count."""
        k0 = getattr(self, "k0", None)
        if k0 is not None and k0 > top_k:
            raise PolicyError(f"{self.name}: key 'k0' must be <= top_k={top_k}, got {k0}", key="k0")
        max_p = getattr(self, "max_p", None)
        if max_p is not None and max_p > num_experts:
            raise PolicyError(
                f"{self.name}: key 'max_p' must be <= num_experts={num_experts}, got {max_p}", key="max_p")

    def __str__(self) -> str:
        return format_policy(self)


@dataclass(frozen=True)
class TopK(Policy):
    """The unchanged router: each token's top-k experts."""

    name: ClassVar[str] = "topk"


@dataclass(frozen=True)
class XShare(Policy):
    """XShare Alg. 2 (budget m) and the threshold form of Alg. 1 (tau); needs m or tau."""

    name: ClassVar[str] = "xshare"
    m: int | None = _param(_Int(1))
    k0: int = _param(_Int(0), 1)
    tau: float | None = _param(_Float(0.0, math.inf, low_open=True))

    def _check(self) -> None:
        if self.m is None and self.tau is None:
            raise PolicyError("xshare: needs key 'm' (expert budget) or 'tau' (score threshold)", key="m")


@dataclass(frozen=True)
class XShareSpec(Policy):
    """XShare Alg. 3-4 for speculative decoding: per-request budget mr, then batch budget m."""

    name: ClassVar[str] = "xshare-spec"
    _decode_only: ClassVar[bool] = True
    m: int | None = _param(_Int(1))
    mr: int | None = _param(_Int(1))
    k0: int = _param(_Int(0), 1)

    def _check(self) -> None:
        if self.m is None and self.mr is None:
            raise PolicyError("xshare-spec: needs key 'm' (batch budget) or 'mr' (per-request budget)", key="m")


@dataclass(frozen=True)
class XShareEP(Policy):
    """XShare Alg. 5-6 for expert parallelism: at most mg experts per GPU beyond the warm-up."""

    name: ClassVar[str] = "xshare-ep"
    mg: int = _param(_Int(1))
    k0: int = _param(_Int(0), 1)

    def _check(self) -> None:
        if self.mg is None:
            raise PolicyError("xshare-ep: needs key 'mg' (per-GPU expert budget)", key="mg")


@dataclass(frozen=True)
class OEA(Policy):
    """Opportunistic expert activation: baseline k0 (or mass p), piggyback within rank max_p."""

    name: ClassVar[str] = "oea"
    _decode_only: ClassVar[bool] = True
    k0: int = _param(_Int(0), 0)
    p: float | None = _param(_Float(0.0, 1.0, low_open=True))
    max_p: int | None = _param(_Int(1))

    def _check(self) -> None:
        if self.k0 == 0 and self.p is None:
            raise PolicyError("oea: needs key 'k0' >= 1 (baseline experts) or 'p' (baseline mass)", key="k0")


@dataclass(frozen=True)
class LynxLat(Policy):
    """Lynx-Lat: drop the `drop` least-voted experts of a decode batch; prefill untouched."""

    name: ClassVar[str] = "lynx-lat"
    _decode_only: ClassVar[bool] = True
    drop: int = _param(_Int(0))

    def _check(self) -> None:
        if self.drop is None:
            raise PolicyError("lynx-lat: needs key 'drop' (experts to drop per layer)", key="drop")


@dataclass(frozen=True)
class LynxAcc(Policy):
    """Lynx-Acc: like Lynx-Lat, but the primary experts of tokens with confidence >= conf stay."""

    name: ClassVar[str] = "lynx-acc"
    _decode_only: ClassVar[bool] = True
    drop: int = _param(_Int(0))
    conf: float = _param(_Float(0.0, 1.0), 0.5)

    def _check(self) -> None:
        if self.drop is None:
            raise PolicyError("lynx-acc: needs key 'drop' (experts to drop per layer)", key="drop")


@dataclass(frozen=True)
class MoESpec(Policy):
    """MoE-Spec: hard budget of B experts; truncate or substitute.

    `rank`: `router` (the paper's: routing probabilities summed over the batch's tokens),
    `topk` (each token's top-k weights summed), or `static` (calibration counts from `calib`).

    `calib` is a path on the engine's machine: a front end should accept it only from trusted
    configuration, not from arbitrary clients.
    """

    name: ClassVar[str] = "moe-spec"
    _decode_only: ClassVar[bool] = True
    budget: int = _param(_Int(1))
    rank: str = _param(_Choice(("router", "topk", "static")), "router")
    cover: str = _param(_Choice(("truncate", "substitute")), "truncate")
    calib: str | None = _param(_Path())

    def _check(self) -> None:
        if self.budget is None:
            raise PolicyError("moe-spec: needs key 'budget' (experts per layer)", key="budget")
        if (self.rank == "static") != (self.calib is not None):
            raise PolicyError("moe-spec: key 'calib' (a count file) is required with rank=static "
                              "and allowed only then", key="calib")


_POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (TopK, XShare, XShareSpec, XShareEP, OEA, LynxLat, LynxAcc, MoESpec)
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


# ---- parse and format -------------------------------------------------------------------------------

def _split_pair(name: str, pair: str) -> tuple[str, str]:
    key, sep, text = (part.strip() for part in pair.partition("="))
    if not sep or not key or not text:
        raise PolicyError(f"{name}: '{pair.strip()}' is not of the form key=value")
    return key, text


def _parse_value(cls: type[Policy], key: str, text: str) -> Any:
    specs = {f.name: f.metadata["spec"] for f in dataclasses.fields(cls)}
    if key not in specs:
        allowed = ", ".join(specs) or "none"
        raise PolicyError(f"{cls.name}: unknown key '{key}'; allowed keys: {allowed}", key=key)
    try:
        return specs[key].parse(text)
    except ValueError:
        raise PolicyError(
            f"{cls.name}: key '{key}' must be {specs[key].allowed()}, got '{text}'", key=key) from None


def parse_policy(text: str) -> Policy:
    """Parse `NAME[;key=value]*` into its policy; raise PolicyError saying what is wrong."""
    if not isinstance(text, str):  # checked before the cache: a list is not even hashable
        raise PolicyError(f"a routing policy must be a string like 'xshare;m=8', got {type(text).__name__} {text!r}")
    return _parse_policy(text)


@functools.lru_cache(maxsize=1024)
def _parse_policy(text: str) -> Policy:
    if not text.strip():
        raise PolicyError(f"empty policy; allowed names: {', '.join(POLICY_NAMES)}")
    head, *pairs = text.split(";")
    name = head.strip().lower()
    if name not in _POLICIES:
        raise PolicyError(f"unknown policy '{head.strip()}'; allowed names: {', '.join(POLICY_NAMES)}")
    cls, values = _POLICIES[name], {}
    for pair in pairs:
        key, value_text = _split_pair(name, pair)
        if key in values:
            raise PolicyError(f"{name}: key '{key}' given twice", key=key)
        values[key] = _parse_value(cls, key, value_text)
    return cls(**values)


def format_policy(policy: Policy) -> str:
    """The canonical string of a policy: its name, then every set parameter in field order."""
    parts = [policy.name]
    for f in dataclasses.fields(policy):
        value = getattr(policy, f.name)
        if value is not None:
            parts.append(f"{f.name}={f.metadata['spec'].format(value)}")
    return ";".join(parts)
