"""Render a HF-style Jinja chat template (sandboxed) into a prompt string."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from loom.errors import InvalidRequestError, MissingDependencyError


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 ships with most environments
        raise MissingDependencyError("chat templates need jinja2: pip install jinja2") from e

    def raise_exception(message: str) -> None:
        raise InvalidRequestError(f"chat template rejected the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **kwargs: Any,
) -> str:
    """The prompt text `template` makes of `messages`."""
    return _compile(template).render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **kwargs,
    )
