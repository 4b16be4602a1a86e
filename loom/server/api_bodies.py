"""The bodies `/openapi.json` documents for each route's 200: a model per body, and the table
of which route answers which (and whether it can stream).

These models document; the routes build their bodies as dicts and nothing validates them at
run time (the schema-driven test checks real answers against these schemas). Fields a body
carries only sometimes are optional; objects allow fields not named here (OpenAI's shapes
grow), so a client generated from the schema reads every answer.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int | None = None
    # chat, with a reasoning parser: {"reasoning_tokens": n}
    completion_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(_Body):
    tokens: list[str]
    # A logprob of -inf (a token a constraint forbids) is null in JSON.
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None]
    text_offset: list[int]


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's prompt logprobs: per prompt position None (the first) or {token id: entry}.
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class Completion(_Body):
    """`POST /v1/completions` (with `stream: true`, `text/event-stream` chunks of the same
    shape and `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None
    children: list[Any] | None = None  # `<promise>` children per prompt (Loom's extension)


class ChatMessageOut(_Body):
    role: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None  # with a reasoning parser (vLLM's field)


class ChatChoice(_Body):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletion(_Body):
    """`POST /v1/chat/completions` (streamed: `chat.completion.chunk` events)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    children: list[Any] | None = None


class ModelCard(_Body):
    """`GET /v1/models/{model_id}`: the served model (OpenAI's model object)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(_Body):
    object: Literal["list"]
    data: list[ModelCard]


class Tokenized(_Body):
    tokens: list[int]
    count: int
    max_model_len: int


class Detokenized(_Body):
    prompt: str


class TokenizerInfo(_Body):
    """`GET /tokenizer_info` (vLLM's)."""

    tokenizer_class: str
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    add_bos_token: bool
    chat_template: str | None = None
    model_max_length: int
    vocab_size: int


class Health(_Body):
    status: str


class Version(_Body):
    version: str


class SessionCreated(_Body):
    id: str
    object: Literal["session"]
    num_tokens: int


class SessionState(_Body):
    """A session as `GET /v1/sessions/{id}` and `rewind` show it."""

    id: str
    object: Literal["session"]
    status: str
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    token_ids: list[int]
    text: str
    generating: bool
    pinned: bool


class SessionUsage(_Body):
    prompt_tokens: int
    completion_tokens: int


class SessionGeneration(_Body):
    """One generation segment (streamed: `session.generation.chunk` events, then this)."""

    id: str
    object: Literal["session.generation"]
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    content: str | None = None  # with tools: the text without its calls
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: CompletionLogprobs | None = None
    usage: SessionUsage
    children: list[Any] | None = None


class SessionAppended(_Body):
    id: str
    object: Literal["session"]
    appended_tokens: int
    num_tokens: int


class Sample(_Body):
    token_id: int
    text: str
    logprob: float | None  # null: -inf


class SessionSamples(_Body):
    id: str
    object: Literal["session.samples"]
    samples: list[Sample]


class Deleted(_Body):
    id: str
    object: str
    deleted: bool


class ResponseObject(_Body):
    """OpenAI's response object (streamed: the Responses event stream)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    output_text: str
    usage: dict[str, Any] | None = None
    previous_response_id: str | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class InputItemList(_Body):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class Embedding(_Body):
    object: Literal["embedding"]
    index: int
    # floats, or (encoding_format "base64") the little-endian float32 bytes in base64
    embedding: list[float] | str


class EmbeddingUsage(_Body):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Body):
    """`POST /v1/embeddings`: one embedding per input, in input order."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# (method, path) -> (the 200 body's models (one of), whether it can stream as SSE).
RESPONSES: dict[tuple[str, str], tuple[tuple[type[BaseModel], ...], bool]] = {
    ("get", "/health"): ((Health,), False),
    ("get", "/version"): ((Version,), False),
    ("post", "/v1/completions"): ((Completion,), True),
    ("post", "/v1/chat/completions"): ((ChatCompletion,), True),
    ("post", "/v1/embeddings"): ((EmbeddingList,), False),
    ("get", "/v1/models"): ((ModelList,), False),
    ("get", "/v1/models/{model_id}"): ((ModelCard,), False),
    ("post", "/tokenize"): ((Tokenized,), False),
    ("post", "/detokenize"): ((Detokenized,), False),
    ("get", "/tokenizer_info"): ((TokenizerInfo,), False),
    ("post", "/v1/sessions"): ((SessionCreated,), False),
    ("post", "/v1/sessions/{session_id}/generate"): ((SessionGeneration,), True),
    ("post", "/v1/sessions/{session_id}/append"): ((SessionAppended, SessionGeneration), True),
    ("post", "/v1/sessions/{session_id}/resample"): ((SessionSamples,), False),
    ("post", "/v1/sessions/{session_id}/rewind"): ((SessionState,), False),
    ("get", "/v1/sessions/{session_id}"): ((SessionState,), False),
    ("delete", "/v1/sessions/{session_id}"): ((Deleted,), False),
    ("post", "/v1/responses"): ((ResponseObject,), True),
    ("get", "/v1/responses/{response_id}"): ((ResponseObject,), False),
    ("delete", "/v1/responses/{response_id}"): ((Deleted,), False),
    ("get", "/v1/responses/{response_id}/input_items"): ((InputItemList,), False),
}
# Routes whose 200 is not JSON.
PLAIN_TEXT = {("get", "/metrics"): "Prometheus metrics in the text exposition format"}
