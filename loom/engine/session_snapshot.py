"""A paused session's state as bytes, to continue it in another engine or after a restart.

A snapshot holds what the session's KV does not: its tokens (and which of them were the
prompt), the stored logits of its last position, its sampling parameters, its pin and time
to live, and its structured-output state (the constraint and which tokens the matcher
consumed). Its K/V is not in it: a restore opens the session over the tokens and the
scheduler takes every full block it can from the prefix cache or the KV store (where the
steps saved them as they filled), computing the rest: under the default mode's guarantee
the continuation is the same bits either way.

Bytes: safetensors with the tokens and logits as tensors and the rest as JSON metadata. A
session that is generating, or a member of a request tree, has no snapshot (its state is
in motion); logits processors (Python objects) are not saved, and a restored session has
none until a segment brings its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from loom.errors import LoomError
from loom.kv_connector.codec import safetensors_header
from loom.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

FORMAT = "loom-session-1"


class SessionSnapshotError(LoomError):
    """Bytes that are not a usable session snapshot (truncated, corrupt, another format)."""


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    """The sampling parameters as JSON values (logits processors left out)."""
    out: dict[str, Any] = {}
    for f in fields(SamplingParams):
        value = getattr(params, f.name)
        if f.name == "logits_processors":
            continue
        if isinstance(value, RequestOutputKind):
            value = value.name
        elif isinstance(value, StructuredOutputsParams):
            value = {g.name: getattr(value, g.name) for g in fields(StructuredOutputsParams)}
        elif f.name == "logit_bias" and value is not None:
            value = {str(k): v for k, v in value.items()}
        out[f.name] = value
    return out


def params_from_json(data: dict[str, Any]) -> SamplingParams:
    """`params_to_json`'s inverse (validated as any SamplingParams)."""
    values = dict(data)
    values["output_kind"] = RequestOutputKind[values.get("output_kind", "CUMULATIVE")]
    if values.get("structured_outputs") is not None:
        values["structured_outputs"] = StructuredOutputsParams(**values["structured_outputs"])
    if values.get("logit_bias") is not None:
        values["logit_bias"] = {int(k): float(v) for k, v in values["logit_bias"].items()}
    known = {f.name for f in fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in values.items() if k in known})


@dataclass(frozen=True)
class SessionSnapshot:
    """A paused session's state (see the module docstring); `to_bytes` / `from_bytes`."""

    session_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    params: SamplingParams
    pinned: bool = False
    ttl_s: float | None = None
    # The float32 logits row of the last position (None: not computed when saved).
    logits: torch.Tensor | None = None
    # The structured-output matcher: the positions of the tokens it consumed (None: none).
    grammar_positions: tuple[int, ...] | None = None
    # The saving engine's KV fingerprint (None without a KV store): informative; a restore
    # under another one recomputes what its store does not hold.
    kv_fingerprint: str | None = None

    def to_bytes(self) -> bytes:
        """The snapshot as safetensors bytes."""
        tensors = {"token_ids": torch.tensor(self.token_ids, dtype=torch.int64)}
        if self.logits is not None:
            tensors["logits"] = self.logits.detach().to("cpu", torch.float32).contiguous()
        state = {
            "session_id": self.session_id,
            "num_prompt_tokens": self.num_prompt_tokens,
            "params": params_to_json(self.params),
            "pinned": self.pinned,
            "ttl_s": self.ttl_s,
            "grammar_positions": None if self.grammar_positions is None
            else list(self.grammar_positions),
            "kv_fingerprint": self.kv_fingerprint,
        }
        return save_safetensors(tensors, metadata={"format": FORMAT,
                                                   "state": json.dumps(state)})

    @classmethod
    def from_bytes(cls, data: bytes) -> SessionSnapshot:
        """Parse `to_bytes`'s output; a `SessionSnapshotError` names what is wrong."""
        metadata = safetensors_header(data, SessionSnapshotError,
                                      "session snapshot").get("__metadata__") or {}
        if metadata.get("format") != FORMAT:
            raise SessionSnapshotError(
                f"not a Loom session snapshot (format {metadata.get('format')!r}, "
                f"expected {FORMAT!r})")
        try:
            tensors = load_safetensors(data)
            state = json.loads(metadata["state"])
            token_ids = tuple(int(t) for t in tensors["token_ids"].tolist())
            positions = state.get("grammar_positions")
            snapshot = cls(
                session_id=str(state["session_id"]),
                token_ids=token_ids,
                num_prompt_tokens=int(state["num_prompt_tokens"]),
                params=params_from_json(state["params"]),
                pinned=bool(state.get("pinned", False)),
                ttl_s=state.get("ttl_s"),
                logits=tensors.get("logits"),
                grammar_positions=None if positions is None else tuple(positions),
                kv_fingerprint=state.get("kv_fingerprint"),
            )
        except LoomError:
            raise
        except Exception as error:  # a damaged body: any parse failure names the snapshot
            raise SessionSnapshotError(
                f"corrupt session snapshot: {type(error).__name__}: {error}") from None
        if not 1 <= snapshot.num_prompt_tokens <= len(token_ids):
            raise SessionSnapshotError(
                f"corrupt session snapshot: {snapshot.num_prompt_tokens} prompt tokens of "
                f"{len(token_ids)}")
        return snapshot
