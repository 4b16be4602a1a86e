"""The decoder-only causal LM skeleton every architecture fills with its own layers."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.profiler import record_function

from loom.attention import get_forward_context
from loom.errors import InvalidModelError
from loom.models.config import ModelConfig
from loom.models.expert_tensors import FusedExpertTensor, split_expert_tensors
from loom.models.fused_decode import FusedDecoder
from loom.models.layers import Linear
from loom.models.weight_shard import ShardRule, WeightSelector


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
    # The fused CPU decode path (see fused_decode.py): off switch, decoder, and why not built.
    use_fused_decode: bool = True
    fused_decoder: FusedDecoder | None = None
    fused_decode_status: str = "not built"
    # HF weight-name prefixes that carry no text-model weights (vision towers, ...).
    ignored_prefixes: tuple[str, ...] = ()
    # Checkpoint tensors holding every expert of a projection, cut per expert as they load
    # (`loom.models.expert_tensors`; gpt-oss).
    fused_expert_tensors: tuple[FusedExpertTensor, ...] = ()
    # Tensor parallelism (loom.models.tensor_parallel): the slice of its checkpoint tensor
    # each sharded parameter holds, and whether the (untied) output projection loads from
    # the embedding's tensor. Empty / False for a whole model.
    weight_shards: dict[str, ShardRule] = {}  # noqa: RUF012 (replaced, never mutated)
    lm_head_from_embedding: bool = False

    def __init__(self, config: ModelConfig, body: DecoderBody, tie_embeddings: bool) -> None:
        super().__init__()
        self.config = config
        self.model = body
        self.tie_embeddings = tie_embeddings
        # embed_scale as a 0-d tensor per (dtype, device), made at first use.
        self._embed_scales: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, H] of the packed tokens (attention metadata from the context).

        On the CPU the layers run through `FusedDecoder` when it supports the model (one C
        call for all layers): every step in w8a8, small steps (decodes, short appends)
        otherwise; everything else runs the modules.
        """
        h = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            # Scale in the model dtype, as the reference implementations do.
            h = h * self._embed_scale_tensor(h.dtype, h.device)
        ctx = get_forward_context()
        use_fused = self.use_fused_decode and ctx.backend.fused_cpu_decode
        fused = self._fused_decoder() if use_fused else None
        if fused is not None and fused.applies(h, ctx.metadata, ctx.kv_caches):
            # Named for profiles: the C call is not a torch operator.
            with record_function("loom::fused_decode"):
                h = fused.run(h, positions, ctx.metadata, ctx.kv_caches)
        else:
            for layer in self.model.layers:
                h = layer(positions, h)
        return self.model.norm(h)

    def _embed_scale_tensor(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The embedding scale as a 0-d tensor, made once per dtype and device: a copy from
        the host inside a forward would be a synchronisation (and break CUDA graph capture)."""
        key = (dtype, device)
        if key not in self._embed_scales:
            self._embed_scales[key] = torch.tensor(self.embed_scale, dtype=dtype, device=device)
        return self._embed_scales[key]

    def invalidate_fused_decoder(self) -> None:
        """Forget the fused decoder (after weights changed); the next decode rebuilds it."""
        self.fused_decoder, self.fused_decode_status = None, "not built"

    def _fused_decoder(self) -> FusedDecoder | None:
        """Built at the first decode (after weights, fusion and quantisation are final)."""
        if self.fused_decoder is None and self.fused_decode_status == "not built":
            self.fused_decoder, self.fused_decode_status = FusedDecoder.build(
                list(self.model.layers)
            )
        return self.fused_decoder

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits [N, V] in float32 for the given hidden rows."""
        with record_function("loom::lm_head"):
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

    def weight_selector(self) -> WeightSelector:
        """The loaders' `select`: checkpoint name -> the part of it a sharded parameter holds
        (None: the whole tensor)."""
        shards = self.weight_shards

        def select(hf_name: str) -> ShardRule | None:
            name = self.map_weight_name(hf_name)
            return None if name is None else shards.get(name)

        return select

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        on_loaded: Callable[[str], None] | None = None,
        materialize_on: torch.device | str = "cpu",
    ) -> None:
        """Copy (hf_name, tensor) pairs into parameters. A sharded model's stream must come
        from a loader given `weight_selector()`: its tensors are already this rank's parts.

        A parameter still on the meta device is allocated (on `materialize_on`) when its
        tensor arrives, so a model built on the meta device holds only what has loaded so
        far; `on_loaded(name)` runs after each parameter is filled (the loader prepares a
        layer as soon as its last weight is in, see `loom.runner.loading`).

        Raises `InvalidModelError` for a weight with no parameter, a shape the config does not
        expect (a config.json that disagrees with the weights), or a parameter left unset.
        """
        # Parameters not loaded yet. A loaded one is dropped from here at once, so that a
        # layer the loader prepares (and replaces) while loading frees its float weights.
        pending: dict[str, nn.Parameter] = dict(self.named_parameters())
        loaded: set[str] = set()

        def fill(name: str, hf_name: str, tensor: torch.Tensor) -> None:
            if name in loaded:
                raise InvalidModelError(f"checkpoint holds weight {hf_name!r} twice")
            self._load_param(name, pending.pop(name), hf_name, tensor, materialize_on)
            loaded.add(name)
            if on_loaded is not None:
                on_loaded(name)

        if self.fused_expert_tensors:
            weights = split_expert_tensors(weights, self.fused_expert_tensors)
        for hf_name, tensor in weights:
            name = self.map_weight_name(hf_name)
            if name is None:
                continue
            if self.lm_head_from_embedding and name == "model.embed_tokens.weight":
                part = self.weight_shards["lm_head.weight"].apply(tensor)
                fill("lm_head.weight", hf_name, part)
            if name not in pending and name not in loaded:
                raise InvalidModelError(
                    f"checkpoint weight {hf_name!r} has no parameter {name!r} in"
                    f" {type(self).__name__}"
                )
            fill(name, hf_name, tensor)
            del tensor  # the stream's reference: the parameter (or its prepared form) holds it
        if pending:
            missing = sorted(pending)
            raise InvalidModelError(
                f"checkpoint lacks weights for {len(missing)} parameters of"
                f" {type(self).__name__}: {missing[:5]}"
            )

    def _load_param(self, name: str, param: nn.Parameter, hf_name: str,
                    tensor: torch.Tensor, materialize_on: torch.device | str) -> None:
        """Copy `tensor` into parameter `name` (allocating it first if it is on meta, or
        taking `tensor` itself as its storage where it can). A meta `tensor` carries no
        values (a weight the model computes from the file's blocks, see
        `loom.loader.gguf_file.iter_gguf_weights`): the parameter is left as it is."""
        got, want = tuple(tensor.shape), tuple(param.shape)
        if got != want:
            raise InvalidModelError(
                f"tensor {hf_name!r} has shape {got}, config expects {want}"
                " (the model config and the weights disagree)"
            )
        if tensor.is_meta:
            return
        if param.is_meta:
            owner_name, _, attr = name.rpartition(".")
            if _owns_its_storage(tensor, param.dtype, torch.device(materialize_on)):
                data = tensor.detach()  # the loader's fresh tensor becomes the parameter
            else:
                data = torch.empty(want, dtype=param.dtype, device=materialize_on)
                with torch.no_grad():
                    data.copy_(tensor)
            setattr(self.get_submodule(owner_name), attr, nn.Parameter(data, requires_grad=False))
            return
        with torch.no_grad():
            param.copy_(tensor)


def _owns_its_storage(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `tensor` can become a parameter as it is: the right dtype and device, and the
    sole user of all of its storage (not a view into a larger tensor, whose storage it would
    keep alive, nor memory the loader maps from the file)."""
    if tensor.dtype != dtype or tensor.device.type != device.type or tensor.requires_grad:
        return False
    if device.index is not None and tensor.device.index != device.index:
        return False
    return (tensor._base is None and tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
            and tensor.untyped_storage().resizable())
