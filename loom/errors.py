"""The exception hierarchy: every error Loom raises on purpose derives from `LoomError`."""

from __future__ import annotations


class LoomError(Exception):
    """Root of every deliberate Loom error. `param` names the request field at fault, where
    one is, and `code` is a machine-readable reason (an HTTP adapter puts both in OpenAI's
    error body; its status follows from the error's class). Both survive pickling, so an
    error raised in a replica reaches the server whole."""

    def __init__(self, *args: object, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(*args)
        self.param = param
        self.code = code


class ModelNotFoundError(LoomError):
    """A model that does not exist: a path or alias that does not resolve to files on disk,
    or a name a server does not serve."""


class UnsupportedModelError(LoomError):
    """A model whose architecture (or file format) Loom cannot run."""


class InvalidModelError(LoomError, ValueError):
    """A model file that is damaged or disagrees with its config (truncated, corrupt, wrong
    shapes); the message names the file and the problem."""


class MissingDependencyError(LoomError):
    """An optional package is needed; the message names the extra to install."""


class InvalidSamplingParamsError(LoomError, ValueError):
    """A sampling parameter out of range; the message names the parameter and why."""


class InvalidRequestError(LoomError, ValueError):
    """A request that cannot be accepted as given (empty prompt, bad fragment, ...)."""


class PromptTooLongError(InvalidRequestError):
    """A prompt (or a session after an append) longer than the context limit."""


class ContextLengthError(PromptTooLongError):
    """A request whose prompt and `max_tokens` do not fit the context (`param` names which)."""


class DuplicateRequestError(LoomError, KeyError):
    """A request id that is already in use."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownRequestError(LoomError, KeyError):
    """A request id the engine does not know (never added, or already finished)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SessionClosedError(UnknownRequestError):
    """An operation on a session that was closed, aborted or has expired."""


class SessionLostError(UnknownRequestError):
    """A session whose engine replica is gone (killed, crashed, scaled down) with no shared
    store to continue it from; the message names the replica and the cause."""


class ReplicaUnavailableError(LoomError):
    """No engine replica can take the request now (none is running, or the one a request
    must reach is draining)."""


class InvalidSessionStateError(LoomError):
    """An operation that the session's current state does not allow."""


class AuthenticationError(LoomError):
    """A request without a valid API key."""


class QuotaExceededError(LoomError):
    """A caller past one of its quotas (a key's open sessions)."""


class RequestFailedError(LoomError):
    """The engine could not serve a request it had accepted (its KV pool held by pinned
    sessions, a failed KV load under "fail", a failed step): nothing is wrong with the
    request itself."""


class KVConnectorError(LoomError):
    """A KV connector that cannot be found or started from the given configuration."""


class TensorParallelError(LoomError):
    """A tensor-parallel group that cannot start or lost a rank (the message names the rank
    and why); the engine's requests fail with it and its other ranks are stopped."""


class EngineShutDownError(LoomError):
    """The engine was shut down: requests still waiting for outputs end with this, and
    later calls are refused with it."""
