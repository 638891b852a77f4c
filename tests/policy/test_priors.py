import math

import pytest

from gateway.policy import InvalidPriors, PresetPriors
from tests.policy.helpers import key, make_policy


def test_weight_is_the_larger_of_key_and_family():
    priors = PresetPriors(keys={key(1): 3.0, key(2): 0.5}, families={"docs": 1.0})
    assert priors.weight(key(1), "docs") == 3.0
    assert priors.weight(key(2), "docs") == 1.0
    assert priors.weight(key(3), None) == 0.0
    assert priors.as_dict() == {"keys": {key(1): 3.0, key(2): 0.5}, "families": {"docs": 1.0}}


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"keys": {"abc": 1.0}}, "keys"),
        ({"keys": {key(0xABC).upper(): 1.0}}, "keys"),
        ({"keys": {key(1): 0}}, f"keys.{key(1)}"),
        ({"keys": {key(1): math.nan}}, f"keys.{key(1)}"),
        ({"keys": {key(1): True}}, f"keys.{key(1)}"),
        ({"families": {"": 1.0}}, "families"),
        ({"families": {"x" * 129: 1.0}}, "families"),
        ({"families": {"docs": "high"}}, "families.docs"),
    ],
)
def test_bad_priors_are_refused(kwargs, param):
    with pytest.raises(InvalidPriors) as caught:
        PresetPriors(**kwargs)
    assert caught.value.param == param


def test_new_priors_reweigh_tracked_entries():
    policy = make_policy()
    policy.insert(key(1), 10, family="docs")
    policy.set_priors(PresetPriors(families={"docs": 2.5}))
    assert policy.get(key(1)).prior_weight == 2.5
    assert policy.preset_score(policy.get(key(1))) == 2.5
    policy.set_priors(PresetPriors())
    assert policy.get(key(1)).prior_weight == 0.0
