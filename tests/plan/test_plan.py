"""The plan and profile types shared by the gateway and the workers: round trips and refusals."""

from __future__ import annotations

import json

import pytest

from plan import (
    APPROXIMATE,
    EXACT,
    MISS,
    PARTIAL_PASS,
    PLAN_VERSION,
    PUBLIC_PLAN_KEY,
    RID_PREFIX,
    VLCACHE,
    ImagePlan,
    PlanError,
    RecomputeProfile,
    RequestPlan,
    plan_key,
    recompute_count,
)
from settings.secret import DataPlaneSecret

A, B = "a" * 64, "b" * 64


def test_request_plan_round_trips_through_json() -> None:
    plan = RequestPlan(images=(
        ImagePlan(key=A, kind=MISS, tokens=64, grid=(8, 8)),
        ImagePlan(key=B, kind=EXACT, tokens=6, grid=(2, 3), ratios=(0.5, 0.1, 0.0)),
        ImagePlan(key=B, kind=APPROXIMATE, tokens=6, grid=(2, 3), alias=A, warmup_layers=3, reuse=(4, 1),
                  recompute_share=0.3, change_map="=~x=~=", similarity=0.93),
        ImagePlan(key=B, kind=APPROXIMATE, tokens=6, grid=(2, 3), alias=A, alias_grid=(3, 3), shift=(-1, 0),
                  change_map="==x===", reuse=(0, 2, 5), selector=VLCACHE, vision=PARTIAL_PASS, derive=True),
    ))
    wire = plan.to_json()
    assert " " not in wire and json.loads(wire)["version"] == PLAN_VERSION
    back = RequestPlan.from_json(wire)
    assert back == plan and back.images[2].reuse == (1, 4) and back.images[2].alias_grid == (2, 3)
    scoped = RequestPlan(images=plan.images[:1], scope="revisit-ns-0123abcd")
    assert RequestPlan.from_json(scoped.to_json()) == scoped and scoped.reported
    assert not RequestPlan(images=(ImagePlan(key=A, kind=MISS, tokens=64, grid=(8, 8), store=False),)).reported
    assert back.images[3].shift == (-1, 0) and back.images[3].alias_grid == (3, 3)
    assert back.images[3].vision == PARTIAL_PASS and back.images[2].vision == "full"  # change-blind: 2 reused
    assert back.images[3].derive and not back.images[2].derive


def test_a_shift_lines_tokens_up_with_the_alias_grid() -> None:
    scrolled = ImagePlan(key=B, kind=APPROXIMATE, tokens=6, grid=(2, 3), alias=A, shift=(1, -1),
                         change_map="xxx==x")
    # new (1, 0) shows alias (0, 1); row 0 scrolled in; column 2 of row 1 would come from alias column 3: none
    assert [scrolled.alias_token(i) for i in range(6)] == [None, None, None, 1, 2, None]


@pytest.mark.parametrize(("change", "message"), [
    ({"key": "A" * 64}, "hex"),
    ({"kind": "guess"}, "kind"),
    ({"tokens": 5}, "tokens"),
    ({"grid": [0, 6]}, "grid"),
    ({"kind": EXACT, "ratios": [0.1, 0.2]}, "non-increasing"),
    ({"kind": EXACT, "ratios": [1.5]}, r"\[0, 1\]"),
    ({"ratios": [0.1]}, "exact"),
    ({"kind": APPROXIMATE}, "alias"),
    ({"kind": APPROXIMATE, "alias": A}, "alias"),  # its own key
    ({"kind": APPROXIMATE, "alias": B, "reuse": [6], "change_map": "======"}, "reuse"),
    ({"kind": APPROXIMATE, "alias": B, "reuse": [1, 1], "change_map": "======"}, "reuse"),
    ({"reuse": [1]}, "approximate"),
    ({"shift": [1, 0]}, "approximate"),
    ({"change_map": "======"}, "approximate"),
    ({"kind": APPROXIMATE, "alias": B, "change_map": "==="}, "change_map"),
    ({"kind": APPROXIMATE, "alias": B, "change_map": "==?==="}, "change_map"),
    ({"kind": APPROXIMATE, "alias": B, "change_map": "=x====", "reuse": [1]}, "changed"),
    ({"kind": APPROXIMATE, "alias": B, "change_map": "xxx===", "shift": [1, 0], "reuse": [0]}, "aligned"),
    ({"kind": APPROXIMATE, "alias": B, "change_map": "======", "selector": "magic"}, "selector"),
    ({"kind": APPROXIMATE, "alias": B, "change_map": "======", "alias_grid": [0, 3]}, "alias_grid"),
    ({"vision": "partial"}, "approximate"),
    ({"derive": True}, "approximate"),
    ({"kind": APPROXIMATE, "alias": B, "change_map": "======", "vision": "half"}, "vision"),
    ({"kind": APPROXIMATE, "alias": B, "change_map": "=x====", "reuse": [1], "selector": "attention_only"},
     "changed"),
    ({"colour": "blue"}, "unknown"),
])
def test_bad_image_plans_are_refused(change: dict, message: str) -> None:
    data = {"key": A, "kind": MISS, "tokens": 6, "grid": [2, 3], **change}
    with pytest.raises(PlanError, match=message):
        RequestPlan.from_json(json.dumps({"version": PLAN_VERSION, "images": [data]}))


@pytest.mark.parametrize("wire", ["not json", "[]", '{"version": 3, "images": []}', '{"version": 4}',
                                  '{"version": 4, "images": [3]}', '{"version": 4, "images": [], "scope": 7}',
                                  '{"version": 4, "images": [], "scope": "a/../b"}'])
def test_bad_request_plans_are_refused(wire: str) -> None:
    with pytest.raises(PlanError):
        RequestPlan.from_json(wire)


def test_recompute_count_is_the_floor() -> None:
    assert [recompute_count(r, 64) for r in (0.0, 0.02, 0.05, 0.1, 0.3, 1.0)] == [0, 1, 3, 6, 19, 64]
    assert recompute_count(0.29, 100) == 29  # no float shortfall (0.29 * 100 = 28.999...)


def test_profile_saves_loads_and_is_checked(tmp_path) -> None:
    profile = RecomputeProfile(model="m", layers=4, budget=0.1, ratios=(0.2, 0.1, 0.1, 0.0), metric="kl",
                               calibration={"samples": 3})
    path = tmp_path / "profile.json"
    profile.save(path)
    assert RecomputeProfile.load(path) == profile and abs(profile.mean_ratio - 0.1) < 1e-12
    with pytest.raises(PlanError, match="budget"):
        RecomputeProfile(model="m", layers=2, budget=0.1, ratios=(0.3, 0.0))
    with pytest.raises(PlanError, match="non-increasing"):
        RecomputeProfile(model="m", layers=2, budget=0.5, ratios=(0.0, 0.3))
    with pytest.raises(PlanError, match="one ratio per layer"):
        RecomputeProfile(model="m", layers=3, budget=0.5, ratios=(0.1, 0.0))
    (tmp_path / "other.json").write_text('{"kind": "something else"}')
    with pytest.raises(PlanError, match="not a recompute profile"):
        RecomputeProfile.load(tmp_path / "other.json")
    with pytest.raises(PlanError, match="cannot read"):
        RecomputeProfile.load(tmp_path / "missing.json")


KEY = plan_key(DataPlaneSecret(b"s" * 32))


def test_plans_ride_in_the_request_id() -> None:
    plan = RequestPlan(images=(ImagePlan(key=A, kind=EXACT, tokens=64, grid=(8, 8), ratios=(0.5,) * 12),))
    rid = plan.to_rid("req-1", key=KEY)
    assert rid.startswith(f"{RID_PREFIX}req-1.") and rid.endswith(".")
    assert RequestPlan.from_rid(rid, key=KEY) == plan
    assert RequestPlan.from_rid(rid + "_1", key=KEY) == plan  # a suffix after the last dot is ignored
    assert RequestPlan.from_rid("chatcmpl-123", key=KEY) is None and RequestPlan.from_rid(None, key=KEY) is None
    with pytest.raises(PlanError, match="MAC"):
        RequestPlan.from_rid(f"{RID_PREFIX}req-1.not*base64.x.", key=KEY)
    with pytest.raises(PlanError):
        RequestPlan.from_rid(f"{RID_PREFIX}req-1", key=KEY)
    with pytest.raises(PlanError, match="request_id"):
        plan.to_rid("has.dots", key=KEY)


def test_a_plan_is_executed_only_under_the_secret_it_was_made_with() -> None:
    plan = RequestPlan(images=(ImagePlan(key=A, kind=EXACT, tokens=64, grid=(8, 8)),), scope="revisit-ns-a")
    rid = plan.to_rid("req-1", key=KEY)
    request_id, packed, tag = rid.removeprefix(RID_PREFIX).split(".")[:3]
    other = RequestPlan(images=(ImagePlan(key=B, kind=EXACT, tokens=64, grid=(8, 8)),), scope="revisit-ns-a")
    other_packed = other.to_rid("req-1", key=KEY).split(".")[2]
    for forged in (plan.to_rid("req-1", key=PUBLIC_PLAN_KEY),  # made without the secret
                   plan.to_rid("req-1", key=plan_key(DataPlaneSecret(b"t" * 32))),  # under another secret
                   f"{RID_PREFIX}req-2.{packed}.{tag}.",  # moved to another request
                   f"{RID_PREFIX}{request_id}.{other_packed}.{tag}.",  # another plan under this one's MAC
                   f"{RID_PREFIX}{request_id}.{packed}.."):  # no MAC
        with pytest.raises(PlanError, match="MAC|authenticated"):
            RequestPlan.from_rid(forged, key=KEY)
