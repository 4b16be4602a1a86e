"""Triton backend: paged attention kernels for CUDA (loom.kernels.triton_attention).

Prefill chunks, decodes and verification chunks of a step go to one kernel launch per layer
(plus a merge launch when contexts are split into parts); nothing is gathered and nothing is
synchronised with the host: the step's tiling is planned once from the metadata's host-side
lengths and shared by every layer.
"""

from __future__ import annotations

import torch

from loom.attention.backend import AttentionBackend, AttentionSpec
from loom.attention.metadata import AttentionMetadata
from loom.attention.torch_backend import write_kv

# Programs a launch should have for the GPU to be busy (a few per SM of an H100's 132).
_TARGET_PROGRAMS = 512


def triton_available() -> bool:
    """Whether Triton imports (it ships with PyTorch's CUDA builds)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class TritonAttentionBackend(AttentionBackend):
    """Stores new K/V with one index copy, then one paged-attention kernel over the step."""

    name = "triton"
    fused_cpu_decode = False  # on a CPU (the interpreter, in tests) these kernels must run

    def __init__(self, split: bool | None = None, target_programs: int = _TARGET_PROGRAMS,
                 part_keys: int | None = None) -> None:
        """`split` forces one program per part of each context (True) or per work item
        (False) instead of choosing per step so that about `target_programs` programs run;
        `part_keys` (tests) cuts contexts into parts of that many keys instead of
        `PART_KEYS`. Neither changes a bit of the result, only how it is launched."""
        from loom.kernels import triton_attention

        self._kernels = triton_attention
        self.split = split
        self.target_programs = target_programs
        self.part_keys = part_keys or triton_attention.PART_KEYS

    @staticmethod
    def plan_key(group: int, num_kv_heads: int) -> tuple[str, int, int]:
        """Where a step's plan lives in `AttentionMetadata.plan_cache` (the decode graphs put
        theirs there at capture)."""
        return ("triton", group, num_kv_heads)

    def reads_only_written_slots(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> bool:
        """The kernel loads only keys in [first visible, seq_len) of each sequence (masked
        loads of the rest read nothing)."""
        return True

    def forward(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Store k/v at the step's slots, then attend every query over its paged context."""
        write_kv(kv_cache, k, v, metadata.slot_mapping)
        group = spec.num_heads // spec.num_kv_heads
        key = self.plan_key(group, spec.num_kv_heads)
        plan = metadata.plan_cache.get(key)
        if plan is None:
            plan = self._kernels.make_plan(
                metadata.query_lens_list, metadata.seq_lens_list, group, spec.num_kv_heads,
                q.device, self.target_programs, self.split, self.part_keys,
            )
            metadata.plan_cache[key] = plan
        out = self._kernels.paged_attention(
            q, kv_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
            metadata.positions, plan, spec.scale, spec.sliding_window, spec.logit_softcap,
            None if spec.sinks is None else spec.sinks.float().contiguous(),
        )
        return out.flatten(1)


def check_against_reference(backend: TritonAttentionBackend, spec: AttentionSpec,
                            device: torch.device, dtype: torch.dtype,
                            kv_cache_dtype: torch.dtype) -> str | None:
    """Run the kernels once on a small synthetic step (a prefill chunk after a cached
    prefix, beside a decode) and compare with the torch reference backend: None when they
    agree, else why not (a compile error, a launch failure, a wrong result). The runner
    calls it at start-up, so a GPU or Triton version the kernels do not work on falls back
    to the reference instead of failing requests later."""
    from loom.attention.torch_backend import TorchAttentionBackend

    block_size, chunks = 16, [(5, 27), (40, 1)]  # (cached prefix, new tokens) per sequence
    blocks = [list(range(0, 3)), list(range(3, 6))]
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device)

    cache = rand(2, 6, block_size, spec.num_kv_heads, spec.head_dim).to(kv_cache_dtype)
    tokens = sum(n for _, n in chunks)
    q = rand(tokens, spec.num_heads, spec.head_dim).to(dtype)
    k = rand(tokens, spec.num_kv_heads, spec.head_dim).to(dtype)
    v = rand(tokens, spec.num_kv_heads, spec.head_dim).to(dtype)
    results = []
    try:
        for candidate in (backend, TorchAttentionBackend()):
            md = AttentionMetadata.build([s for s, _ in chunks], [n for _, n in chunks],
                                         blocks, block_size, device)
            results.append(candidate.forward(spec, q, k, v, cache.clone(), md).float())
    except Exception as error:  # a kernel that cannot compile or launch here
        return f"{type(error).__name__}: {error}"
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    worst = float((results[0] - results[1]).abs().max())
    if not worst <= tolerance:  # also catches nan
        return f"differs from the reference by {worst:.3g} (tolerance {tolerance})"
    return None
