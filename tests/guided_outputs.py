"""What a guided output must be, for the guides the tests send (tests/unit/engine/test_guided.py
through the engine, tests/e2e/test_structured_output.py through the server)."""
from __future__ import annotations

import json
import re

REGEX = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"
# the language of the tests' EBNF grammars: a parenthesised sum of numbers 0..99
SUMS = r"\((?:[0-9]|[1-9][0-9])(?:\+(?:[0-9]|[1-9][0-9]))*\)"


def valid(kind: str, text: str, schema: dict | None = None) -> bool:
    """Whether ``text`` is what a guide of ``kind`` allows: ``regex`` (:data:`REGEX`),
    ``ebnf_grammar`` (:data:`SUMS`), ``json`` (any JSON value) or ``json_schema`` (a JSON
    value that :func:`conforms` to ``schema``).

    >>> valid("regex", "ab@cd.org"), valid("ebnf_grammar", "(1+23)"), valid("json", "[1")
    (True, True, False)
    """
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "ebnf_grammar":
        return re.fullmatch(SUMS, text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return kind == "json" or conforms(value, schema)


def conforms(value, schema: dict) -> bool:
    """Whether ``value`` matches ``schema``, in the part of JSON Schema the tests' schemas
    use: objects with every property and no other, strings (``maxLength``), integers
    (``minimum``, ``maximum``), arrays (``items``, ``maxItems``) and ``enum``.

    >>> conforms({"n": 3}, {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2}}})
    False
    """
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        properties = schema["properties"]
        return (isinstance(value, dict) and set(value) == set(properties)
                and all(conforms(value[k], s) for k, s in properties.items()))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return type(value) is int and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(conforms(v, schema["items"]) for v in value))
    raise ValueError(f"schema type {kind!r}: conforms() knows object, string, integer, array and enum")
