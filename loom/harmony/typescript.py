"""Function tools as the harmony format shows them to the model: the `# Tools` section of
the developer message, each function a TypeScript-like type whose argument `_` is its
JSON schema written as a type, character for character as the openai-harmony package
writes it (its quirks included: a nested object's fields keep the outer indentation and its
closing brace gets the inner one; descriptions are not split into lines there).

A schema maps by these rules, in this order:
- `oneOf` (a list): each variant on its own line ` | <type>`, with `| null` when it is
  `nullable`, and its description and default as a trailing comment;
- `type` as a list: the names joined with ` | ` (`integer` as `number`);
- `type: object`: `{`, then per property its title, description and examples as `//`
  comment lines, `name?: <type>,` (`?` unless required) and its default as a trailing
  comment, then `}`; a property with `oneOf` lists its variants under `name:`;
- `string` (its `enum` as quoted alternatives), `number`/`integer` (`number`), `boolean`,
  `array` (`<items>[]`, or `Array<any>`); anything else is `any`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, Protocol


class ToolSpec(Protocol):
    """A function tool: its name, description and arguments' JSON schema (or None)."""

    name: str
    description: str
    parameters: dict[str, Any] | None


def _get(schema: Any, key: str) -> Any:
    return schema.get(key) if isinstance(schema, dict) else None


def _is_enum(schema: Any) -> bool:
    values = _get(schema, "enum")
    return isinstance(values, list) and len(values) > 0


def _float_text(value: float) -> str:
    """A float as the package's JSON writer spells it: shortest digits, in plain notation
    while the decimal point lies at most 16 digits right of the first digit or 4 zeros left
    of it, else as `1.5e20` / `1e-7` (no `+`, no padded exponent)."""
    if not math.isfinite(value):
        return "null"
    sign = "-" if value < 0 else ""
    mantissa, _, exponent = repr(abs(value)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    all_digits = whole + fraction
    zeros = len(all_digits) - len(all_digits.lstrip("0"))
    digits = all_digits[zeros:].rstrip("0")
    if not digits:
        return sign + "0.0"
    point = len(whole) - zeros + int(exponent or 0)  # value = 0.<digits> * 10**point
    if 0 < point <= 16:
        if len(digits) <= point:
            return sign + digits + "0" * (point - len(digits)) + ".0"
        return sign + digits[:point] + "." + digits[point:]
    if -5 < point <= 0:
        return sign + "0." + "0" * -point + digits
    tail = "." + digits[1:] if len(digits) > 1 else ""
    return f"{sign}{digits[0]}{tail}e{point - 1}"


def json_text(value: Any) -> str:
    """`value` as compact JSON, as the package's JSON writer spells it."""
    if isinstance(value, float):
        return _float_text(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json_text(str(k))}:{json_text(v)}"
                              for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(json_text(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _default_text(schema: Any) -> str:
    """A property's default in its comment: a string quoted (bare for an enum's)."""
    value = schema["default"]
    if isinstance(value, str):
        return value if _is_enum(schema) else f'"{value}"'
    return json_text(value)


def _nullable(type_text: str, schema: Any) -> str:
    if _get(schema, "nullable") is True and "null" not in type_text:
        return type_text + " | null"
    return type_text


def _one_of(variants: list[Any], indent: str) -> str:
    """A schema that is a `oneOf`: one variant per line."""
    out = []
    for variant in variants:
        line = f"\n{indent} | " + _nullable(schema_type(variant, indent + "   "), variant)
        notes = []
        if isinstance(_get(variant, "description"), str):
            notes.append(variant["description"])
        if isinstance(variant, dict) and "default" in variant:
            value = variant["default"]
            quoted = isinstance(value, str) and not _is_enum(variant)
            notes.append(f'default: "{value}"' if quoted else f"default: {json_text(value)}")
        out.append(line + (f" // {' '.join(notes)}" if notes else ""))
    return "".join(out)


def _property_one_of(key: str, optional: str, prop: dict[str, Any], variants: list[Any],
                     indent: str) -> str:
    """A property whose schema has a `oneOf`: comments, `name?:`, one variant per line."""
    out = ""
    description = prop.get("description")
    description = description if isinstance(description, str) else None
    first = variants[0] if variants else None
    above = description is not None and _get(first, "description") != description
    if above:
        out += f"{indent}// {description}\n"
    if "default" in prop:
        out += f"{indent}// default: {_default_text(prop)}\n"
    out += f"{indent}{key}{optional}:\n"
    for i, variant in enumerate(variants):
        out += f"{indent} | " + _nullable(schema_type(variant, indent + "   "), variant)
        notes = []
        variant_description = _get(variant, "description")
        if not (i == 0 and above) and isinstance(variant_description, str) \
                and variant_description != description:
            notes.append(variant_description)
        if isinstance(variant, dict) and "default" in variant:
            notes.append(f"default: {_default_text(variant)}")
        out += (f" // {' '.join(notes)}" if notes else "") + "\n"
    return out + f"{indent},\n"


def _object(schema: dict[str, Any], indent: str) -> str:
    out = ""
    if isinstance(schema.get("description"), str):
        out += f"{indent}// {schema['description']}\n"
    out += "{\n"
    properties = schema.get("properties")
    if isinstance(properties, dict):
        required_list = schema.get("required")
        required = {r for r in required_list if isinstance(r, str)} \
            if isinstance(required_list, list) else set()
        for key, prop in properties.items():
            optional = "" if key in required else "?"
            if isinstance(_get(prop, "title"), str):
                out += f"{indent}// {prop['title']}\n{indent}//\n"
            has_one_of = isinstance(prop, dict) and "oneOf" in prop
            if not has_one_of and isinstance(_get(prop, "description"), str):
                out += f"{indent}// {prop['description']}\n"
            examples = _get(prop, "examples")
            if isinstance(examples, list) and examples:
                out += f"{indent}// Examples:\n"
                out += "".join(f'{indent}// - "{e}"\n' for e in examples if isinstance(e, str))
            if isinstance(_get(prop, "oneOf"), list):
                out += _property_one_of(key, optional, prop, prop["oneOf"], indent)
                continue
            out += f"{indent}{key}{optional}: "
            out += _nullable(schema_type(prop, indent + "    "), prop) + ","
            if not has_one_of and isinstance(prop, dict) and "default" in prop:
                out += f" // default: {_default_text(prop)}"
            out += "\n"
    return out + f"{indent}}}"


def schema_type(schema: Any, indent: str = "") -> str:
    """A JSON schema written as a type (module docstring); `indent` prefixes the lines of
    an object's fields."""
    if isinstance(_get(schema, "oneOf"), list):
        return _one_of(schema["oneOf"], indent)
    kind = _get(schema, "type")
    if isinstance(kind, list):
        names = ["number" if k == "integer" else k for k in kind if isinstance(k, str)]
        if names:
            return " | ".join(names)
    if not isinstance(kind, str):
        return "any"
    if kind == "object":
        return _object(schema, indent)
    if kind == "string":
        values = _get(schema, "enum")
        names = [f'"{v}"' for v in values if isinstance(v, str)] if isinstance(values, list) \
            else []
        return " | ".join(names) if names else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        return schema_type(schema["items"], indent) + "[]" if "items" in schema \
            else "Array<any>"
    return "any"


def lines(text: str) -> list[str]:
    """`text`'s lines as the package splits them: at `\\n`, a line's final `\\r` dropped,
    no empty last line after a final newline."""
    if not text:
        return []
    parts = text.split("\n")
    if parts[-1] == "":
        parts.pop()
    return [p[:-1] if p.endswith("\r") else p for p in parts]


def tools_section(tools: Sequence[ToolSpec], namespace: str = "functions") -> str:
    """The `# Tools` section that offers `tools` in `namespace`."""
    body = [f"## {namespace}\n"]
    if tools:
        body.append(f"namespace {namespace} {{\n")
        for tool in tools:
            body += [f"// {line}" for line in lines(tool.description)]
            if tool.parameters is not None:
                body.append(f"type {tool.name} = (_: {schema_type(tool.parameters)}) => any;\n")
            else:
                body.append(f"type {tool.name} = () => any;\n")
        body.append(f"}} // namespace {namespace}")
    return "# Tools\n\n" + "\n".join(body)
