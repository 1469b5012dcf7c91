"""The learner group's collectives: torch.distributed, NCCL on GPU, gloo on CPU (no Ray here).

A group of N learners holds one LoRA: every rank starts from the same weights and optimizer
state, the gradient is all-reduced (summed: each rank's loss is already scaled by its share of
the mini-batch) before every optimizer step, so every rank takes the same step and stays equal.
"""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600  # a collective waiting longer than this raises instead of hanging


def free_port() -> int:
    """A TCP port free on this host now (for rank 0's rendezvous; as veRL / OpenRLHF pick one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_group(address: str, port: int, rank: int, world: int, device, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the group (blocks until all `world` ranks have joined)."""
    if dist.is_initialized():
        raise RuntimeError("this process is already in a torch.distributed group; a learner joins one group once")
    dist.init_process_group(backend_for(device), init_method=f"tcp://{address}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


class Group:
    """The collectives the update needs; a world of 1 does none (a single learner is unchanged)."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    @classmethod
    def current(cls) -> "Group":
        return cls(dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else cls()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks (float64 stays float64: statistics are summed exactly enough)."""
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def min_(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return t

    def sum_grads_(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients over ranks, as one flat buffer (one collective per optimizer step)."""
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n
