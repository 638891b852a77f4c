"""bench/body_lag.py: the bodies it parses are what it says, and both ways of parsing them are measured."""

from __future__ import annotations

import json

import gateway.json_body
from bench.body_lag import body_of, measure


def test_a_body_holds_its_images_and_both_parses_are_timed() -> None:
    raw = body_of(2, 4)
    parts = json.loads(raw)["messages"][0]["content"]
    assert len(raw) > 2_000_000 and [p["type"] for p in parts] == ["image_url"] * 4 + ["text"]
    limit = gateway.json_body.LONG_STRINGS_BODY
    for cut in (False, True):
        lag, took = measure(raw, cut, 1)
        assert lag >= 0 and took > 0
        assert gateway.json_body.LONG_STRINGS_BODY == limit  # put back
