"""Attention over a paged KV cache: metadata, forward context, backends."""

from loom.attention.backend import AttentionBackend, AttentionSpec, allocate_kv_caches
from loom.attention.context import ForwardContext, forward_context, get_forward_context
from loom.attention.cpu_backend import CpuAttentionBackend
from loom.attention.layer import PagedAttention
from loom.attention.metadata import AttentionMetadata
from loom.attention.selector import get_attention_backend
from loom.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "CpuAttentionBackend",
    "ForwardContext",
    "PagedAttention",
    "TorchAttentionBackend",
    "allocate_kv_caches",
    "forward_context",
    "get_attention_backend",
    "get_forward_context",
]
