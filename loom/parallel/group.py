"""One tensor-parallel group on torch.distributed: who this process is, and its collectives.

Two process groups over the same ranks:

    device group    the model's all-reduces and all-gathers (NCCL on CUDA, gloo on a CPU),
                    with a timeout (`LOOM_TP_TIMEOUT_S`, default 600 s): a rank that stops
                    answering inside a step fails the step instead of hanging it
    control group   gloo, the driver's messages between steps (the step's scheduler output,
                    the workers' KV load errors, shutdown); a worker may wait there for the
                    next request for as long as the server is idle, so it has no timeout

A rank whose process dies closes its sockets: every other rank's next collective raises.
The group also holds the TCP store the ranks met through, where a worker leaves the reason
it is about to exit (`report_error`) for the driver to read (`reported_errors`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle

import torch
import torch.distributed as dist

from loom.errors import TensorParallelError

_IDLE_TIMEOUT = datetime.timedelta(days=3650)


def step_timeout() -> datetime.timedelta:
    """How long a collective inside a step may wait for the other ranks."""
    return datetime.timedelta(seconds=float(os.environ.get("LOOM_TP_TIMEOUT_S", "600")))


class TensorParallelGroup:
    """This process's place in a group of `world_size` ranks; rank 0 drives."""

    def __init__(self, rank: int, world_size: int, device: torch.device,
                 store: dist.Store | None,
                 control: dist.ProcessGroup) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.store = store
        self._control = control

    @classmethod
    def create(cls, rank: int, world_size: int, store: dist.Store | None,
               device: torch.device) -> TensorParallelGroup:
        """Set up both process groups through `store` (the TCP store rank 0 serves), or,
        with None, from torch.distributed's environment (`MASTER_ADDR`, `MASTER_PORT`,
        `RANK`, `WORLD_SIZE`, as torchrun sets them). Blocks until every rank has joined."""
        if dist.is_initialized():
            raise TensorParallelError(
                "torch.distributed is already initialised in this process: one "
                "tensor-parallel engine per process (shut the other one down first)")
        backend = "nccl" if device.type == "cuda" else "gloo"
        options: dict[str, object] = {"timeout": step_timeout()}
        if device.type == "cuda":
            torch.cuda.set_device(device)
            options["device_id"] = device
        if store is None:
            dist.init_process_group(backend, init_method="env://", rank=rank,
                                    world_size=world_size, **options)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    **options)
        control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        return cls(rank, world_size, device, store, control)

    # ---- inside the model (every rank, the same calls in the same order) -------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        dist.all_reduce(x)  # the device group is the default (world) group
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    # ---- between steps (the control group) ------------------------------------------------

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj`, on every rank (others pass nothing)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def gather_objects(self, obj: object) -> list[object] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        out: list[object] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self._control)
        return out

    def report_error(self, message: str) -> None:
        """Leave why this rank is failing where the driver can read it."""
        if self.store is None:  # launched by torchrun: the rank's own log has it
            return
        with contextlib.suppress(Exception):  # the store lives in the driver: gone with it
            self.store.set(f"loom/error/{self.rank}", pickle.dumps(message))

    def reported_errors(self) -> dict[int, str]:
        """rank -> the message it left with `report_error` (rank 0 reads)."""
        errors: dict[int, str] = {}
        if self.store is None:
            return errors
        for rank in range(1, self.world_size):
            key = f"loom/error/{rank}"
            try:
                if self.store.check([key]):
                    errors[rank] = pickle.loads(self.store.get(key))
            except Exception:
                continue
        return errors

    def destroy(self) -> None:
        """Leave torch.distributed (this process may then join another group)."""
        if dist.is_initialized():
            dist.destroy_process_group()
