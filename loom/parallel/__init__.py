"""Tensor parallelism on torch.distributed: the group, the driver's executor, the workers.

The model side (how layers split, the collectives inside them) is `loom.models.
tensor_parallel`; `EngineArgs(tensor_parallel_size=N)` reaches `executor.launch`.
"""
