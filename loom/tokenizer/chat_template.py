"""`ChatTemplate`: find a model's Jinja chat template, render messages, tokenize them.

Where a template comes from, first found wins: `--chat-template` (a file or the text), the
tokenizer's or model's files (a HF folder's `chat_template.jinja`, `tokenizer_config.json`,
`chat_template.json`; a GGUF's `tokenizer.chat_template`), then a template Loom ships for the
model (`packaged_templates`: Gemma 3, whose GGUF conversions carry none).

The one chat-template renderer: the engine's input processor (`InputProcessor.encode_chat`)
and `loom serve` both render through it, so a conversation becomes the same ids either way.

Rendering follows transformers' `apply_chat_template`: a sandboxed Jinja environment with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a no-op `{% generation %}` tag,
HF's `tojson` filter and the globals `raise_exception`, `strftime_now`, `dict`, `namespace`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loom.errors import LoomError
from loom.tokenizer.packaged_templates import fallback_template
from loom.tokenizer.packaged_templates import read_json_object as _read_json
from loom.tokenizer.text_checks import NOT_TEXT, has_unpaired_surrogate

if TYPE_CHECKING:
    # The module, not the package: the package's __init__ exports this module's names.
    from loom.tokenizer.tokenizer import Tokenizer

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class ChatTemplateError(LoomError):
    """No chat template, messages a template cannot take, or a template that fails."""

    @classmethod
    def missing(cls, model: str | Path) -> ChatTemplateError:
        """The error for a model without a template."""
        return cls(f"model {str(model)!r} has no chat template; pass --chat-template FILE")


class _Rejected(Exception):
    """`raise_exception` inside a template (turned into a ChatTemplateError by `render`)."""


def _raise_exception(message: str) -> None:
    raise _Rejected(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` in templates, without exposing the `dict` type itself (as transformers)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _environment() -> Any:
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a dependency
        raise ChatTemplateError("chat templates need jinja2: pip install jinja2") from e

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (HF's assistant mask): renders its body."""

        tags = {"generation"}  # noqa: RUF012 - jinja2's own class attribute

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    class Namespace(jinja2.utils.Namespace):
        """`namespace(...)` refusing underscore attributes, as transformers does."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            for name in dict(*rest, **kwargs):
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} not allowed")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = Namespace
    return env


def _message_for_template(index: int, message: Any) -> dict[str, Any]:
    """A copy of one message with its content flattened to a string; ChatTemplateError if bad."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ChatTemplateError(f"{where} must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ChatTemplateError(
            f"{where} has role {role!r}; expected one of {', '.join(sorted(ROLES))}"
        )
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        pieces = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(
                    f"{where}.content[{j}] has type {kind!r}; only 'text' parts are supported"
                )
            if not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"{where}.content[{j}] needs a string 'text'")
            pieces.append(part["text"])
        text = "".join(pieces)
    else:
        raise ChatTemplateError(
            f"{where}.content must be a string or a list of text parts, "
            f"got {type(content).__name__}"
        )
    if has_unpaired_surrogate(text):
        raise ChatTemplateError(f"{where}.content {NOT_TEXT}")
    return {**message, "content": text}


# ---------------------------------------------------------------- finding a template


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _hf_folder_template(folder: Path) -> tuple[str | None, str, str, str]:
    """(template, bos, eos, origin) of a HF folder; template None when it has none."""
    tok_cfg = _read_json(folder / "tokenizer_config.json")
    special = _read_json(folder / "special_tokens_map.json")
    bos = _token_text(tok_cfg.get("bos_token")) or _token_text(special.get("bos_token"))
    eos = _token_text(tok_cfg.get("eos_token")) or _token_text(special.get("eos_token"))
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), bos, eos, str(jinja)
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: "default", else the first
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str):
        return template, bos, eos, str(folder / "tokenizer_config.json")
    template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, str):
        return template, bos, eos, str(folder / "chat_template.json")
    return None, bos, eos, str(folder)


def _gguf_template(path: Path) -> tuple[str | None, str, str, str]:
    """(template, bos, eos, origin) from a GGUF file's metadata (the tensors are not read)."""
    from loom.loader.gguf_reader import GGUFFile

    try:
        gguf = GGUFFile(path)
    except LoomError:
        return None, "", "", str(path)

    def token(index: Any) -> str:
        if not isinstance(index, int):
            return ""
        try:
            return str(gguf.array_item("tokenizer.ggml.tokens", index))
        except (KeyError, IndexError):
            return ""

    bos = token(gguf.get("tokenizer.ggml.bos_token_id"))
    eos = token(gguf.get("tokenizer.ggml.eos_token_id"))
    template = gguf.get("tokenizer.chat_template")
    if isinstance(template, str) and template.strip():
        return template, bos, eos, f"{path} (tokenizer.chat_template)"
    return None, bos, eos, str(path)


def _model_files_template(path: Path) -> tuple[str | None, str, str, str]:
    """The template a model or tokenizer path carries: a HF folder, a .gguf, tokenizer.json."""
    if path.is_file():
        if path.suffix == ".gguf":
            return _gguf_template(path)
        return _hf_folder_template(path.parent)
    if path.is_dir():
        found = _hf_folder_template(path)
        if found[0] is not None:
            return found
        # A folder of one GGUF (beside a tokenizer.json or not): the file's own template.
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            carried = _gguf_template(ggufs[0])
            if carried[0] is not None or not (path / "tokenizer.json").is_file():
                return carried
        return found
    return None, "", "", str(path)


def _override_text(override: str | Path) -> tuple[str, str]:
    """(template, origin) of `--chat-template`: a file, or (a str with Jinja tags) the text."""
    path = Path(override).expanduser()
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # template text too long or too odd to be a path
        is_file = False
    if is_file:
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"cannot read chat template file {str(path)!r}: {e}") from e
    if isinstance(override, str) and ("{{" in override or "{%" in override):
        return override, "--chat-template text"
    raise ChatTemplateError(f"chat template file {str(override)!r} does not exist")


# ---------------------------------------------------------------- the template


class ChatTemplate:
    """A compiled Jinja chat template plus the BOS/EOS strings it is rendered with."""

    def __init__(
        self, template: str, bos_token: str = "", eos_token: str = "", origin: str = "<string>"
    ) -> None:
        import jinja2

        self.template = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = origin
        try:
            self._compiled = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"chat template from {origin} has a syntax error on line {e.lineno}: {e.message}"
            ) from e

    @classmethod
    def from_model(
        cls, model_path: Path, tokenizer_path: Path, override: str | Path | None = None
    ) -> ChatTemplate | None:
        """The override's template, else the tokenizer's or model's files' one, else one Loom
        ships for the model (Gemma 3: `packaged_templates`); None if none."""
        paths = [Path(tokenizer_path).expanduser()]
        if Path(model_path).expanduser() != paths[0]:
            paths.append(Path(model_path).expanduser())
        found = [_model_files_template(p) for p in paths]
        bos = next((f[1] for f in found if f[1]), "")
        eos = next((f[2] for f in found if f[2]), "")
        if override is not None:
            text, origin = _override_text(override)
            return cls(text, bos, eos, origin)
        for template, _, _, origin in found:
            if template is not None:
                return cls(template, bos, eos, origin)
        shipped = fallback_template(paths)
        return cls(shipped[0], bos, eos, shipped[1]) if shipped is not None else None

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text of `messages` (ChatTemplateError for bad messages or a failure)."""
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("messages must be a non-empty list")
        plain = [_message_for_template(i, m) for i, m in enumerate(messages)]
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra}
        try:
            text = self._compiled.render(
                messages=plain, add_generation_prompt=add_generation_prompt, **variables
            )
        except _Rejected as e:
            raise ChatTemplateError(f"chat template rejected the messages: {e}") from None
        except ChatTemplateError:
            raise
        except Exception as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
        if has_unpaired_surrogate(text):  # from a message's other fields, tools or variables
            raise ChatTemplateError(f"the rendered prompt {NOT_TEXT}")
        return text

    def render_ids(
        self,
        tokenizer: Tokenizer,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> list[int]:
        """Token ids of the rendered prompt, with BOS once: the template's, else the tokenizer's.

        The text is encoded without special tokens (a template that writes `bos_token` gives
        BOS itself); BOS is prepended only when the tokenizer would add one and the text lacks
        it. EOS is never appended (a prompt is not a finished sequence).
        """
        ids = tokenizer.encode(
            self.render(messages, add_generation_prompt, **extra), add_special_tokens=False
        )
        bos = tokenizer.bos_token_id
        if bos is not None and tokenizer.add_bos_token and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, bos={self.bos_token!r})"
