import dataclasses

from gateway.tenancy import namespace_for


def test_no_key_uses_the_default_namespace():
    assert namespace_for(None, mapping={}, default="default") == "default"


def test_each_key_gets_its_own_namespace_and_the_key_never_shows():
    a = namespace_for("Bearer sk-alice", mapping={}, default="d")
    b = namespace_for("Bearer sk-bob", mapping={}, default="d")
    assert a != b and "sk-alice" not in a
    assert namespace_for("Bearer sk-alice", mapping={}, default="d") == a


def test_operator_mapping_shares_a_namespace():
    mapping = {"sk-alice": "team", "sk-bob": "team"}
    assert namespace_for("Bearer sk-alice", mapping=mapping, default="d") == "team"
    assert namespace_for("Bearer sk-bob", mapping=mapping, default="d") == "team"


def test_every_request_with_images_carries_its_namespace_scope_to_the_worker():
    from gateway.config import GatewayConfig
    from gateway.images import canonicalize
    from gateway.intake import IntakeResult
    from gateway.routes.openai_api import scoped_plan, upstream_body
    from gateway.tenancy import cache_scope
    from plan import MISS, RequestPlan
    from tests.images_lib import encode, small

    config = GatewayConfig(model="m", workers=("http://w",))
    image = canonicalize(encode(small("coffee.png")), limits=config.images, processor=config.processor, model="m",
                         namespace="ns-a")
    intake = IntakeResult(upstream_body={}, params=None, images=(image,), namespace="ns-a",  # type: ignore[arg-type]
                          prefix_digests=("p",))
    plan = scoped_plan(None, intake, "ns-a")  # reuse off: no plan was made
    assert plan is not None and plan.scope == cache_scope("ns-a") != cache_scope("ns-b")
    assert [(p.key, p.strategy, p.store) for p in plan.images] == [(image.key, MISS, False)] and not plan.reported
    body = upstream_body({"messages": []}, namespace="ns-a", rid=plan.to_rid("r1"))
    assert body["extra_key"] == plan.scope and RequestPlan.from_rid(body["rid"]) == plan
    assert scoped_plan(None, dataclasses.replace(intake, images=()), "ns-a") is None  # text only: no plan
