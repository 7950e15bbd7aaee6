"""The routing-policy grammar: parsing, canonical round trips, clear rejections, no torch."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from moe_cohort.engine.policy import (
    OEA, POLICY_NAMES, LynxLat, MoESpec, PolicyError, TopK, XShare, format_policy, parse_policy,
)

ROOT = Path(__file__).resolve().parents[2]

CANONICAL = [
    "topk", "xshare;m=24;k0=1", "xshare;k0=0;tau=0.5", "xshare;m=8;k0=2;tau=1e-05",
    "xshare-spec;m=32;mr=8;k0=1", "xshare-spec;mr=4;k0=0", "xshare-ep;mg=6;k0=1", "oea;k0=4",
    "oea;k0=0;p=0.9;max_p=12", "lynx-lat;drop=16", "lynx-acc;drop=8;conf=0.75",
    "moe-spec;budget=32;rank=router;cover=substitute",
    "moe-spec;budget=16;rank=static;cover=truncate;calib=/data/counts=v2.json",
]


@pytest.mark.parametrize("text", CANONICAL)
def test_canonical_strings_round_trip(text):
    policy = parse_policy(text)
    assert str(policy) == format_policy(policy) == text
    assert parse_policy(str(policy)) == policy


@pytest.mark.parametrize("text,canonical", [
    ("xshare;m=24", "xshare;m=24;k0=1"),
    (" XShare ; k0 = 1 ; m=24 ", "xshare;m=24;k0=1"),
    ("moe-spec;budget=32;rank=router;cover=substitute", "moe-spec;budget=32;rank=router;cover=substitute"),
    ("moe-spec;budget=32", "moe-spec;budget=32;rank=router;cover=truncate"),
    ("lynx-acc;drop=4", "lynx-acc;drop=4;conf=0.5"),
    ("oea;k0=+4", "oea;k0=4"),
    ("xshare;tau=1", "xshare;k0=1;tau=1.0"),
])
def test_equivalent_spellings_format_to_one_canonical_form(text, canonical):
    assert str(parse_policy(text)) == canonical


def test_every_name_is_a_policy_with_typed_fields():
    examples = {"topk": "topk", "xshare": "xshare;m=4", "xshare-spec": "xshare-spec;m=4",
                "xshare-ep": "xshare-ep;mg=2", "oea": "oea;k0=2", "lynx-lat": "lynx-lat;drop=1",
                "lynx-acc": "lynx-acc;drop=1", "moe-spec": "moe-spec;budget=4"}
    assert set(examples) == set(POLICY_NAMES)
    for name, text in examples.items():
        assert parse_policy(text).name == name
    policy = parse_policy("xshare;m=24;k0=0;tau=0.25")
    assert isinstance(policy, XShare) and (policy.m, policy.k0, policy.tau) == (24, 0, 0.25)
    assert isinstance(policy.m, int) and isinstance(policy.tau, float)


def test_policies_are_frozen_and_hashable():
    policy = parse_policy("oea;k0=2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.k0 = 3
    assert {policy: 1}[OEA(k0=2)] == 1


def test_decode_only():
    assert parse_policy("lynx-lat;drop=4").decode_only
    assert parse_policy("lynx-acc;drop=4").decode_only
    assert parse_policy("oea;k0=1").decode_only and parse_policy("moe-spec;budget=4").decode_only
    assert not parse_policy("topk").decode_only
    assert not parse_policy("xshare;m=4").decode_only


@pytest.mark.parametrize("text,key,message", [
    ("", None, "empty policy; allowed names: topk, xshare"),
    ("xshar;m=3", None, "unknown policy 'xshar'; allowed names: topk, xshare, xshare-spec"),
    ("xshare;q=3", "q", "xshare: unknown key 'q'; allowed keys: m, k0, tau"),
    ("topk;m=3", "m", "topk: unknown key 'm'; allowed keys: none"),
    ("xshare;m=abc", "m", "xshare: key 'm' must be an integer >= 1, got 'abc'"),
    ("xshare;m=2.5", "m", "key 'm' must be an integer >= 1, got '2.5'"),
    ("xshare;m=0", "m", "xshare: key 'm' must be an integer >= 1, got 0"),
    ("xshare;m=4;m=5", "m", "xshare: key 'm' given twice"),
    ("xshare;m", None, "xshare: 'm' is not of the form key=value"),
    ("xshare;;m=3", None, "xshare: '' is not of the form key=value"),
    ("xshare;m=", None, "'m=' is not of the form key=value"),
    ("xshare", "m", "xshare: needs key 'm' (expert budget) or 'tau'"),
    ("xshare;tau=0", "tau", "key 'tau' must be a finite number > 0, got 0.0"),
    ("xshare;tau=nan", "tau", "key 'tau' must be a finite number > 0, got nan"),
    ("xshare;tau=inf", "tau", "key 'tau' must be a finite number > 0, got inf"),
    ("xshare;k0=-1;m=2", "k0", "key 'k0' must be an integer >= 0, got -1"),
    ("xshare-spec;k0=1", "m", "xshare-spec: needs key 'm' (batch budget) or 'mr'"),
    ("xshare-ep", "mg", "xshare-ep: needs key 'mg'"),
    ("oea", "k0", "oea: needs key 'k0' >= 1 (baseline experts) or 'p'"),
    ("oea;k0=1;p=1.5", "p", "oea: key 'p' must be a number in (0, 1], got 1.5"),
    ("oea;k0=1;max_p=0", "max_p", "key 'max_p' must be an integer >= 1, got 0"),
    ("lynx-lat", "drop", "lynx-lat: needs key 'drop'"),
    ("lynx-acc;drop=2;conf=2", "conf", "lynx-acc: key 'conf' must be a number in [0, 1], got 2.0"),
    ("moe-spec;budget=4;cover=drop", "cover", "key 'cover' must be one of truncate, substitute, got 'drop'"),
    ("moe-spec;budget=4;rank=static", "calib", "key 'calib' (a count file) is required with rank=static"),
    ("moe-spec;budget=4;calib=/x.json", "calib", "required with rank=static and allowed only then"),
])
def test_bad_strings_are_rejected_with_the_key_and_what_is_allowed(text, key, message):
    with pytest.raises(PolicyError) as caught:
        parse_policy(text)
    assert message in str(caught.value)
    assert caught.value.key == key
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("value", [3, 2.5, True, None, ["topk"]])
def test_a_policy_that_is_not_a_string_is_called_what_it_is(value):
    with pytest.raises(PolicyError) as caught:
        parse_policy(value)
    assert str(caught.value) == f"a routing policy must be a string like 'xshare;m=8', got {type(value).__name__} {value!r}"


def test_direct_construction_is_validated_too():
    with pytest.raises(PolicyError, match="key 'budget' must be an integer >= 1, got 0"):
        MoESpec(budget=0)
    with pytest.raises(PolicyError, match="key 'drop' must be an integer >= 0, got True"):
        LynxLat(drop=True)
    assert str(TopK()) == "topk"


def test_validate_for_model():
    parse_policy("oea;k0=4;max_p=16").validate_for_model(top_k=4, num_experts=16)
    with pytest.raises(PolicyError, match=r"key 'k0' must be <= top_k=2, got 4"):
        parse_policy("xshare;m=8;k0=4").validate_for_model(top_k=2, num_experts=16)
    with pytest.raises(PolicyError, match=r"key 'max_p' must be <= num_experts=16, got 17"):
        parse_policy("oea;k0=1;max_p=17").validate_for_model(top_k=4, num_experts=16)


@pytest.mark.integration
def test_policy_module_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import moe_cohort.engine.policy as p\n"
            "assert str(p.parse_policy('xshare;m=24;k0=1')) == 'xshare;m=24;k0=1'\n"
            "assert 'torch' not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
