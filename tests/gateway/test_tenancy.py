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
