"""The trajectory batch: the one contract between sampler, rewards, buffer and learner.

A batch holds B denoising trajectories of T DDIM steps each. Tensors are on the CPU; the
Arrow form (one row per trajectory, tensors as pyarrow fixed-shape tensors) is lossless and is
what goes to disk and across processes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import torch

# Tensor fields, each with the batch as its first dimension.
TENSOR_FIELDS = (
    "latents",  # [B, T+1, C, h, w] float32: z_T ... z_0 (index 0 is the initial noise)
    "timesteps",  # [B, T] int64: the scheduler timestep of each transition
    "log_probs",  # [B, T] float32: log p(z_{i+1} | z_i) under the sampling policy (mean over elements)
    "prompt_embeds",  # [B, L, D] float32: text-encoder states of the prompt
    "images",  # [B, H, W, 3] uint8: decoded z_0; [B, 0, 0, 3] once dropped (without_images)
    "seeds",  # [B] int64: the seed of the trajectory's noise
    "policy_version",  # [B] int64: learner version of the LoRA that sampled it
    "sample_ids",  # [B] int64: unique id, the key that rewards come back with
    "rewards",  # [B] float32: NaN until scored
    "advantages",  # [B] float32: NaN until computed
    "replayed",  # [B] bool: True for rows a training batch replays from an earlier epoch
    # Several rewards (a weighted_sum spec): each term's unweighted reward, [B, R] float32; [B, 0] otherwise.
    "reward_terms",
    # Per-step or per-reward advantages of a credit scheme that needs them (ReCAST: [B, T] "pre",
    # [B, R] "loss"; buffer/credit.py); [B, 0] when the one advantage per row is all there is.
    "term_advantages",
)
# Fields that may have no columns ([B, 0]); the Arrow form leaves them out then (and reads them back so).
_OPTIONAL_WIDTH = ("reward_terms", "term_advantages")


@dataclass
class TrajectoryBatch:
    prompts: list[str]
    latents: torch.Tensor
    timesteps: torch.Tensor
    log_probs: torch.Tensor
    prompt_embeds: torch.Tensor
    images: torch.Tensor
    seeds: torch.Tensor
    policy_version: torch.Tensor
    sample_ids: torch.Tensor
    rewards: torch.Tensor = None
    advantages: torch.Tensor = None
    replayed: torch.Tensor = None
    reward_terms: torch.Tensor = None
    term_advantages: torch.Tensor = None
    # Sampling settings the log-probs depend on; identical for all rows of a batch.
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        b = len(self.prompts)
        if self.rewards is None:
            self.rewards = torch.full((b,), float("nan"))
        if self.advantages is None:
            self.advantages = torch.full((b,), float("nan"))
        if self.replayed is None:
            self.replayed = torch.zeros(b, dtype=torch.bool)
        for name in _OPTIONAL_WIDTH:
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros(b, 0))
        for name in TENSOR_FIELDS:
            t = getattr(self, name)
            if t.shape[0] != b:
                raise ValueError(f"TrajectoryBatch.{name} has {t.shape[0]} rows but there are {b} prompts")
        if self.log_probs.shape != self.timesteps.shape or self.latents.shape[1] != self.timesteps.shape[1] + 1:
            raise ValueError(
                f"inconsistent steps: latents {tuple(self.latents.shape)}, timesteps {tuple(self.timesteps.shape)}, "
                f"log_probs {tuple(self.log_probs.shape)} (need latents[:,T+1], timesteps and log_probs [:,T])"
            )

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def num_steps(self) -> int:
        return self.timesteps.shape[1]

    def select(self, index) -> "TrajectoryBatch":
        """Rows by an index tensor/list/slice, as a new batch."""
        if isinstance(index, slice):
            idx = torch.arange(len(self))[index]
        else:
            idx = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        kw = {name: getattr(self, name)[idx] for name in TENSOR_FIELDS}
        return TrajectoryBatch(prompts=[self.prompts[i] for i in idx.tolist()], meta=dict(self.meta), **kw)

    def with_(self, **changes) -> "TrajectoryBatch":
        return replace(self, **changes)

    def without_images(self) -> "TrajectoryBatch":
        """The batch the buffer, the learners and the checkpoints hold: the images go to the reward
        actors and the image grid only (no one downstream reads them; 18% of an SD1.5 row)."""
        return self.with_(images=torch.zeros(len(self), 0, 0, 3, dtype=torch.uint8))

    @staticmethod
    def cat(batches: list["TrajectoryBatch"]) -> "TrajectoryBatch":
        batches = [b for b in batches if len(b)]
        if not batches:
            raise ValueError("TrajectoryBatch.cat needs at least one non-empty batch")
        for b in batches[1:]:
            if b.meta != batches[0].meta:
                raise ValueError(f"cannot concatenate batches sampled with different settings: {batches[0].meta} vs {b.meta}")
        kw = {name: torch.cat([getattr(b, name) for b in batches]) for name in TENSOR_FIELDS}
        return TrajectoryBatch(prompts=[p for b in batches for p in b.prompts], meta=dict(batches[0].meta), **kw)

    # ------------------------------------------------------------------ Arrow

    def to_arrow(self) -> pa.Table:
        cols = {"prompts": pa.array(self.prompts, pa.string())}
        for name in TENSOR_FIELDS:
            arr = getattr(self, name).detach().cpu().contiguous().numpy()
            if (name in _OPTIONAL_WIDTH or name == "images") and arr.size == 0 and len(arr):
                continue  # pyarrow has no zero-width tensor column; absent reads back as [B, 0] ([B, 0, 0, 3])
            if arr.ndim == 1:
                cols[name] = pa.array(arr)
            else:
                cols[name] = pa.FixedShapeTensorArray.from_numpy_ndarray(arr)
        table = pa.table(cols)
        return table.replace_schema_metadata({b"diffrlhf.meta": _json_dumps(self.meta), b"diffrlhf.version": b"2"})

    @staticmethod
    def from_arrow(table: pa.Table) -> "TrajectoryBatch":
        meta = _json_loads((table.schema.metadata or {}).get(b"diffrlhf.meta", b"{}"))
        kw = {}
        for name in TENSOR_FIELDS:
            if name == "images" and name not in table.column_names:
                kw[name] = torch.zeros(table.num_rows, 0, 0, 3, dtype=torch.uint8)  # dropped before it was written
                continue
            if name in ("replayed", *_OPTIONAL_WIDTH) and name not in table.column_names:
                continue  # replayed: written before the field existed (format 1), no row is replay
            col = table.column(name).combine_chunks()
            arr = col.to_numpy_ndarray() if isinstance(col.type, pa.FixedShapeTensorType) else col.to_numpy(zero_copy_only=False)
            kw[name] = torch.from_numpy(np.array(arr, copy=True))  # own, writable memory
        return TrajectoryBatch(prompts=table.column("prompts").to_pylist(), meta=meta, **kw)

    def __reduce__(self):
        # Any pickling (Ray's object store, multiprocessing) ships the batch in its Arrow IPC form.
        return (TrajectoryBatch.from_ipc_bytes, (self.to_ipc_bytes(),))

    def to_ipc_bytes(self) -> bytes:
        sink = pa.BufferOutputStream()
        table = self.to_arrow()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        return sink.getvalue().to_pybytes()

    @staticmethod
    def from_ipc_bytes(data: bytes) -> "TrajectoryBatch":
        return TrajectoryBatch.from_arrow(pa.ipc.open_stream(pa.py_buffer(data)).read_all())

    def save(self, path) -> None:
        feather.write_feather(self.to_arrow(), str(path), compression="zstd")

    @staticmethod
    def load(path) -> "TrajectoryBatch":
        return TrajectoryBatch.from_arrow(feather.read_table(str(path)))

    def equals(self, other: "TrajectoryBatch") -> bool:
        """Exact equality (NaN == NaN): the Arrow round trip and replay's state are checked with it."""
        if self.prompts != other.prompts or self.meta != other.meta:
            return False
        for f in fields(self):
            if f.name in TENSOR_FIELDS:
                a, b = getattr(self, f.name), getattr(other, f.name)
                if not _tensor_equal(a, b):
                    return False
        return True


def _tensor_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        nan_a, nan_b = a.isnan(), b.isnan()
        return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])
    return torch.equal(a, b)


def _json_dumps(d: dict) -> bytes:
    return json.dumps(d, sort_keys=True).encode()


def _json_loads(b: bytes) -> dict:
    return json.loads(b.decode())
