"""Request bodies of the HTTP API (pydantic): OpenAI's shapes, vLLM's extras, Loom's sessions.

One place to import them from; each group lives in its own module: `request_base` (the base
classes, the surrogate check, typed fields with limits), `request_fields` (sampling, stream
options, constraints), `message_fields` (tools and chat messages), `openai_requests`
(completions, chat, tokenize), `embedding_requests` (embeddings), `session_requests`
(sessions), `response_requests` (the Responses API). Responses are plain dicts built in
`responses.py`.
"""

from __future__ import annotations

from loom.server.embedding_requests import EmbeddingRequest
from loom.server.message_fields import (
    FUNCTION_NAME_PATTERN,
    CalledFunction,
    ChatMessage,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolFields,
)
from loom.server.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Prompt,
    TokenizeRequest,
)
from loom.server.request_base import (
    LIMIT,
    TOKEN_IDS_SCHEMA,
    MaxTokens,
    ModelName,
    NonNegInt,
    RequestBody,
    StrictModel,
    TokenId,
    logger,
    unpaired_surrogate,
    without_ignored_fields,
)
from loom.server.request_fields import (
    IGNORED_FIELDS,
    ConstraintFields,
    JSONSchemaFormat,
    ResponseFormat,
    SamplingFields,
    StreamOptions,
    StructuredOutputsField,
)
from loom.server.response_requests import (
    IGNORED_RESPONSE_FIELDS,
    ResponseFunctionTool,
    ResponseNamedToolChoice,
    ResponsesRequest,
    ResponseText,
    ResponseTextFormat,
)
from loom.server.session_requests import (
    SessionAppendRequest,
    SessionCreateRequest,
    SessionGenerateRequest,
    SessionResampleRequest,
    SessionRewindRequest,
)

__all__ = [
    "FUNCTION_NAME_PATTERN", "IGNORED_FIELDS", "IGNORED_RESPONSE_FIELDS", "LIMIT",
    "TOKEN_IDS_SCHEMA", "CalledFunction", "ChatCompletionRequest", "ChatMessage",
    "CompletionRequest", "ConstraintFields", "DetokenizeRequest", "EmbeddingRequest",
    "FunctionDefinition",
    "FunctionName", "JSONSchemaFormat", "MaxTokens", "ModelName", "NamedToolChoice",
    "NonNegInt", "Prompt", "RequestBody", "ResponseFormat", "ResponseFunctionTool",
    "ResponseNamedToolChoice", "ResponseText", "ResponseTextFormat", "ResponsesRequest",
    "SamplingFields", "SessionAppendRequest", "SessionCreateRequest", "SessionGenerateRequest",
    "SessionResampleRequest", "SessionRewindRequest", "StreamOptions", "StrictModel",
    "StructuredOutputsField", "TextPart", "TokenId", "TokenizeRequest", "Tool", "ToolCall",
    "ToolChoice", "ToolFields", "logger", "unpaired_surrogate", "without_ignored_fields",
]
