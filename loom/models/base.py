"""The decoder-only causal LM skeleton every architecture fills with its own layers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from loom.models.config import ModelConfig
from loom.models.layers import Linear


class DecoderBody(nn.Module):
    """HF-named container: `embed_tokens`, `layers`, `norm` (matches `model.*` weight names)."""

    def __init__(self, embed: nn.Embedding, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class CausalLM(nn.Module):
    """forward(input_ids, positions) -> hidden; compute_logits(hidden) -> float32 logits.

    Subclasses build `self.model` (a `DecoderBody`) and set `embed_scale` / `final_softcap`.
    Layers take (positions, hidden) and return hidden.
    """

    embed_scale: float | None = None
    final_softcap: float | None = None
    # HF weight-name prefixes that carry no text-model weights (vision towers, ...).
    ignored_prefixes: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, body: DecoderBody, tie_embeddings: bool) -> None:
        super().__init__()
        self.config = config
        self.model = body
        self.tie_embeddings = tie_embeddings
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, H] of the packed tokens (attention metadata from the context)."""
        h = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            # Scale in the model dtype, as the reference implementations do.
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype, device=h.device)
        for layer in self.model.layers:
            h = layer(positions, h)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits [N, V] in float32 for the given hidden rows."""
        logits = self.lm_head(hidden).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def map_weight_name(self, name: str) -> str | None:
        """HF checkpoint name -> parameter name of this module (None = skip)."""
        if name.startswith(self.ignored_prefixes) or "rotary_emb.inv_freq" in name:
            return None
        if self.tie_embeddings and name == "lm_head.weight":
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (hf_name, tensor) pairs into parameters; raise if any parameter stays unset."""
        params: dict[str, Any] = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self.map_weight_name(hf_name)
            if name is None:
                continue
            if name not in params:
                raise KeyError(f"checkpoint weight {hf_name!r} has no parameter {name!r}")
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {hf_name!r}: shape {tuple(tensor.shape)} != {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise KeyError(f"checkpoint lacks weights for {len(missing)} parameters: {missing[:5]}")
