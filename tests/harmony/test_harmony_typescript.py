"""Function tools as the harmony format writes them: JSON schemas of many kinds as types."""

from __future__ import annotations

import pytest
from harmony_cases import PING, SCHEMA_ZOO, SCHEMA_ZOO_TS, WEATHER, WEATHER_TS

from loom.harmony.typescript import json_text, lines, schema_type, tools_section


def test_schema_zoo():
    assert tools_section(SCHEMA_ZOO) == (
        "# Tools\n\n## functions\n\nnamespace functions {\n\n" + SCHEMA_ZOO_TS
        + "\n} // namespace functions")


def test_weather_and_ping():
    assert tools_section([WEATHER, PING]) == (
        "# Tools\n\n## functions\n\nnamespace functions {\n\n" + WEATHER_TS
        + "\n// Checks the service.\ntype ping = () => any;\n\n} // namespace functions")


def test_no_tools_is_a_bare_namespace_heading():
    assert tools_section([]) == "# Tools\n\n## functions\n"


@pytest.mark.parametrize(("schema", "expected"), [
    ({"type": "string"}, "string"),
    ({"type": "string", "enum": ["a", 1, "b"]}, '"a" | "b"'),
    ({"type": "integer"}, "number"),
    ({"type": ["integer", "string"]}, "number | string"),
    ({"type": "array", "items": {"type": "boolean"}}, "boolean[]"),
    ({"type": "null"}, "any"),
    ({"anyOf": [{"type": "string"}]}, "any"),
    (True, "any"),
    ({"type": "object"}, "{\n}"),
])
def test_schema_types(schema, expected):
    assert schema_type(schema) == expected


@pytest.mark.parametrize(("value", "expected"), [
    (0.5, "0.5"), (3.0, "3.0"), (-2.25, "-2.25"), (1e15, "1000000000000000.0"),
    (1e16, "1e16"), (1.5e-7, "1.5e-7"), (1e-5, "0.00001"), (1e-6, "1e-6"), (0.0, "0.0"),
    (7, "7"), (True, "true"), (None, "null"), ("é\n", '"é\\n"'),
    ({"a": [1, 2.5]}, '{"a":[1,2.5]}'),
])
def test_json_text(value, expected):
    assert json_text(value) == expected


def test_lines_split_as_the_package_does():
    assert lines("") == []
    assert lines("a\r\nb\n") == ["a", "b"]
    assert lines("a\n\nb") == ["a", "", "b"]
    assert lines("a\u2028b") == ["a\u2028b"]
