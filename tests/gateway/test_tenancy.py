import dataclasses

import pytest

from gateway.config import TenantSettings, key_digest
from gateway.tenancy import InvalidApiKey, Tenants, cache_scope
from settings.secret import DataPlaneSecret

ALICE, BOB = "sk-alice-0123456789", "sk-bob-0123456789ab"


def test_open_mode_without_a_key_uses_the_default_namespace():
    assert Tenants(TenantSettings.open()).identify(None).namespace == "default"


def test_open_mode_gives_each_key_its_own_namespace_and_the_key_never_shows():
    tenants = Tenants(TenantSettings.open())
    a, b = tenants.identify(f"Bearer {ALICE}"), tenants.identify(f"Bearer {BOB}")
    assert a.namespace != b.namespace and ALICE not in a.namespace and ALICE not in a.key_id
    assert tenants.identify(f"Bearer {ALICE}") == a
    assert a.namespace == "key-" + key_digest(ALICE)[:24]  # as earlier versions named it: stored entries still match


def test_operator_mapping_shares_a_namespace():
    for settings in (TenantSettings.open({ALICE: "team", BOB: "team"}),
                     TenantSettings.with_keys({ALICE: "team", BOB: "team"})):
        tenants = Tenants(settings)
        assert tenants.identify(f"Bearer {ALICE}").namespace == tenants.identify(f"Bearer {BOB}").namespace == "team"
        assert tenants.identify(f"Bearer {ALICE}").key_id != tenants.identify(f"Bearer {BOB}").key_id


@pytest.mark.parametrize("authorization", [None, "", "Bearer ", "Bearer EMPTY", "Bearer sk-unknown-0123456789",
                                           f"Bearer {ALICE}x", f"Basic {ALICE}"])
def test_keys_mode_refuses_any_key_it_does_not_list(authorization):
    with pytest.raises(InvalidApiKey) as refused:
        Tenants(TenantSettings.with_keys({ALICE: "team"})).identify(authorization)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert ALICE not in refused.value.message


def test_every_request_with_images_carries_its_namespace_scope_to_the_worker():
    from gateway.config import GatewayConfig
    from gateway.images import canonicalize
    from gateway.intake import IntakeResult
    from gateway.routes.openai_api import scoped_plan, upstream_body
    from plan import MISS, PUBLIC_PLAN_KEY, RequestPlan
    from tests.images_lib import encode, small

    config = GatewayConfig(model="m", workers=("http://w",))
    image = canonicalize(encode(small("coffee.png")), limits=config.images, processor=config.processor, model="m",
                         namespace="ns-a")
    intake = IntakeResult(upstream_body={}, params=None, images=(image,), namespace="ns-a",  # type: ignore[arg-type]
                          prefix_digests=("p",))
    scope = cache_scope("ns-a", b"k" * 32)
    plan = scoped_plan(None, intake, scope)  # reuse off: no plan was made
    assert plan is not None and plan.scope == scope != cache_scope("ns-b", b"k" * 32)
    assert [(p.key, p.kind, p.store) for p in plan.images] == [(image.key, MISS, False)] and not plan.reported
    body = upstream_body({"messages": []}, scope=scope, rid=plan.to_rid("r1", key=PUBLIC_PLAN_KEY))
    assert body["extra_key"] == plan.scope and RequestPlan.from_rid(body["rid"], key=PUBLIC_PLAN_KEY) == plan
    assert scoped_plan(None, dataclasses.replace(intake, images=()), scope) is None  # text only: no plan


def test_no_salt_costs_a_planned_request_its_prefix():
    """The prefix cache is scoped by tenant only: a planned request's text before its images matches what earlier
    requests of its tenant left there (the worker keeps K/V not computed as a full prefill out of it), and a client's
    own cache_salt reaches SGLang unchanged."""
    from gateway.routes.openai_api import upstream_body

    body = upstream_body({"messages": [], "rid": "mine", "cache_salt": "c"}, scope="s", rid="rv6.r1.x.y.")
    assert body["cache_salt"] == "c" and body["extra_key"] == "s" and body["rid"] == "rv6.r1.x.y."
    assert "cache_salt" not in upstream_body({"messages": []}, scope="s", rid="rv6.r1.x.y.")


def test_a_namespace_scope_cannot_be_named_without_the_secret():
    secret = DataPlaneSecret(b"s" * 32)
    caller = Tenants(TenantSettings.open({ALICE: "team"}), secret).identify(f"Bearer {ALICE}")
    assert caller.scope == cache_scope("team", secret.key("cache-scope"))
    for guess in (cache_scope("team", DataPlaneSecret().key("cache-scope")),  # as a worker's visitor could compute
                  cache_scope("team", DataPlaneSecret(b"t" * 32).key("cache-scope"))):
        assert guess != caller.scope
