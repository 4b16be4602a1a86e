"""The base of every request body: unknown fields refused, unpaired surrogates refused,
ignorable fields dropped, and the typed fields whose limits the published schema fills in.

Unknown fields are rejected (`extra="forbid"`) so a misspelt parameter is an error naming it,
not a silently ignored value.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from loom.tokenizer.text_checks import has_unpaired_surrogate

NonNegInt = Annotated[int, Field(ge=0)]

# Limits that depend on the served model or the server's flags: the published schema
# (api_request_rules.py) fills them in where a field's schema carries this key, with its kind
# ("token_id", "token_id_key", "max_tokens", "context": tokens of a session, "model",
# "dimensions": an embedding's sizes the model allows).
LIMIT = "x-loom-limit"
# A token id: below the vocabulary size (the engine's input processor checks it).
TokenId = Annotated[int, Field(ge=0, json_schema_extra={LIMIT: "token_id"})]
# A number of tokens to generate: at most --max-tokens-cap and the context less a token.
MaxTokens = Annotated[int, Field(ge=1, json_schema_extra={LIMIT: "max_tokens"})]
# A model name: the one this server serves (another is a 404).
ModelName = Annotated[str, Field(json_schema_extra={LIMIT: "model"})]
# A non-empty list of token ids, as a schema (a prompt given as token ids).
TOKEN_IDS_SCHEMA = {"type": "array", "minItems": 1,
                    "items": {"type": "integer", "minimum": 0, LIMIT: "token_id"}}

logger = logging.getLogger("loom.server")


def without_ignored_fields(data: Any, ignorable: frozenset[str],
                           declared: Iterable[str]) -> Any:
    """A request body without the `ignorable` fields it carries (those the model does not
    declare), named in one logged warning."""
    if not isinstance(data, dict):
        return data
    ignored = sorted((ignorable & data.keys()) - set(declared))
    if not ignored:
        return data
    logger.warning("ignoring request fields that change nothing here: %s", ", ".join(ignored))
    return {k: v for k, v in data.items() if k not in ignored}


class StrictModel(BaseModel):
    """A request body or a part of one: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")




def _shown(key: Any) -> str:
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


def unpaired_surrogate(value: Any) -> str | None:
    """The path (`messages.0.content`) of the first string in parsed JSON, an object's key
    or a value, that holds an unpaired surrogate; None when there is none."""
    stack: list[tuple[Any, str]] = [(value, "")]  # iterative: any depth of nesting
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if has_unpaired_surrogate(item):
                return path
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                where = f"{path}.{_shown(key)}" if path else _shown(key)
                if isinstance(key, str) and has_unpaired_surrogate(key):
                    return where
                children.append((child, where))
            stack.extend(reversed(children))  # popped in document order
        elif isinstance(item, list | tuple):
            stack.extend(reversed([(child, f"{path}.{i}" if path else str(i))
                                   for i, child in enumerate(item)]))
    return None


class RequestBody(StrictModel):
    """A whole request body (a route's, a WebSocket message's): every string in it, at any
    depth, is checked once here for text no UTF-8 can carry, a 400 naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _reject_unpaired_surrogates(cls, data: Any) -> Any:
        """Refuse a body with an unpaired surrogate anywhere (errors.py names the field)."""
        field = unpaired_surrogate(data)
        if field is not None:
            raise PydanticCustomError("unpaired_surrogate",
                                      "{field} holds an unpaired UTF-16 surrogate",
                                      {"field": field})
        return data
