"""LoRA on the UNet's attention projections through peft, in diffusers' own save format; and the
flat form the learner broadcasts to the samplers (one contiguous buffer per policy version)."""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diffrlhf.keys import default
# The attention projections DDPO trains (model.lora_targets) and the rank (model.lora_rank).
DEFAULT_TARGETS = tuple(default("model.lora_targets"))
DEFAULT_RANK = default("model.lora_rank")


def add_lora(unet, rank: int = DEFAULT_RANK, alpha: float | None = None, targets=DEFAULT_TARGETS, seed: int = 0) -> None:
    """Attach a trainable LoRA adapter (peft) to `unet` in place; only its weights require grad.

    peft initialises lora_A randomly and lora_B to zero, so the adapter starts as the identity;
    we seed that init so every role builds the same starting adapter.
    """
    from peft import LoraConfig

    unet.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, init_lora_weights="gaussian", target_modules=list(targets)))
    # Keep trainable LoRA weights in fp32 even if the base model is fp16/bf16.
    for p in unet.parameters():
        if p.requires_grad:
            p.data = p.data.float()


def lora_parameters(unet) -> list[torch.nn.Parameter]:
    return [p for p in unet.parameters() if p.requires_grad]


@contextlib.contextmanager
def adapter_disabled(unet):
    """Within the block `unet` computes the base model's output (the LoRA bypassed, not changed).

    diffusers' disable_adapters()/enable_adapters() (peft's tuner layers); peft also turns the
    adapter's requires_grad off and back on, so each LoRA tensor's flag is restored as it was. This
    is how DPOK's pretrained prediction is had without holding a second UNet.
    """
    flags = {n: p.requires_grad for n, p in lora_tensors(unet).items()}
    unet.disable_adapters()
    try:
        yield unet
    finally:
        unet.enable_adapters()
        for n, p in lora_tensors(unet).items():
            p.requires_grad_(flags[n])


def lora_tensors(unet) -> dict[str, torch.nn.Parameter]:
    """The adapter's live parameters by name (no copies): what a broadcast is loaded into."""
    return {n: p for n, p in unet.named_parameters() if "lora_" in n}


def lora_state_dict(unet) -> dict[str, torch.Tensor]:
    """The adapter's tensors by parameter name (CPU copies): what checkpoints store."""
    return {n: p.detach().to("cpu", copy=True) for n, p in lora_tensors(unet).items()}


def check_lora_matches(targets: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise unless `shapes` names exactly the tensors of `targets`, each with the same shape.

    A shape check of our own: copy_ would broadcast a (1, n) source into a (4, n) target silently.
    """
    if list(targets) == list(shapes) and [t.shape for t in targets.values()] == list(shapes.values()):
        return  # the usual case, same order: one pass (every sampler runs this on every new version)
    missing = [n for n in targets if n not in shapes]
    unknown = [n for n in shapes if n not in targets]
    if missing or unknown:
        raise KeyError(f"LoRA state does not match the model: missing {missing[:3]}{'...' if len(missing) > 3 else ''} "
                       f"({len(missing)}), unknown {unknown[:3]}{'...' if len(unknown) > 3 else ''} ({len(unknown)})")
    for n, t in targets.items():
        if tuple(t.shape) != tuple(shapes[n]):
            raise ValueError(f"LoRA tensor {n} has shape {tuple(shapes[n])} in the state, {tuple(t.shape)} in the model")


@torch.no_grad()
def load_lora_state_dict(unet, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors (a checkpoint's dict) into `unet` in place (exact; names and shapes must match)."""
    targets = lora_tensors(unet)
    check_lora_matches(targets, {n: tuple(t.shape) for n, t in state.items()})
    for n, t in state.items():
        targets[n].copy_(t)


# ----------------------------------------------------------------------------- the broadcast form

# numpy has no bfloat16: its bits travel as int16 and are viewed back (same element size).
_NUMPY_STORAGE = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64, torch.bfloat16: np.int16}


@dataclass(frozen=True)
class FlatLoRA:
    """One policy version's adapter as ONE contiguous numpy array plus what cuts it into tensors.

    Why numpy: Ray's object store hands numpy arrays to every reader on the node zero-copy (a
    read-only view of the shared memory, pickle protocol 5 out-of-band buffer), while a dict of
    torch tensors is pickled tensor by tensor and every reader unpickles and copies each one. The
    metadata is a few hundred short strings and ints. The buffer may be read-only: read it, never
    write it (to_state_dict() gives owned copies).
    """

    buffer: np.ndarray  # 1-D, contiguous, every tensor back to back in `names` order
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # element offset of each tensor in `buffer`
    dtype: str  # torch dtype name of every tensor ("float32", "bfloat16", ...)

    @property
    def numel(self) -> int:
        return int(self.buffer.size)

    def shapes_by_name(self) -> dict[str, tuple[int, ...]]:
        return dict(zip(self.names, self.shapes))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Torch views of the buffer, by name, without copying it: for reading only.

        One torch.split (a single op for all views) and math.prod: per-tensor slicing and np.prod
        cost ~6 ms for SD1.5's 256 tensors, more than the copies themselves, on every sampler.
        """
        flat = _torch_view(self.buffer).view(getattr(torch, self.dtype))
        parts = torch.split(flat, [math.prod(s) for s in self.shapes])
        return {n: t.view(s) for n, t, s in zip(self.names, parts, self.shapes)}

    def to_state_dict(self) -> dict[str, torch.Tensor]:
        """Owned, writable CPU tensors by name: the dict form (checkpoints keep this form)."""
        return {n: t.clone() for n, t in self.tensors().items()}


def _torch_view(array: np.ndarray) -> torch.Tensor:
    """torch.from_numpy without a copy, also of a read-only array (one read from Ray's store).

    torch warns that it cannot mark a tensor read-only; we only ever read these views (they are
    copy_ sources), so the warning is silenced here instead of copying the whole buffer to get a
    writable one.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def flatten_lora_state(state: dict[str, torch.Tensor]) -> FlatLoRA:
    """Pack adapter tensors (any device, one dtype) into one contiguous CPU buffer: one copy."""
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) > 1:
        raise ValueError(f"a flat LoRA holds one dtype; this state mixes {sorted(str(d) for d in dtypes)}")
    dtype = dtypes.pop() if dtypes else torch.float32
    if dtype not in _NUMPY_STORAGE:
        raise ValueError(f"a flat LoRA holds {sorted(str(d) for d in _NUMPY_STORAGE)}; got {dtype}")
    names = tuple(state)
    shapes = tuple(tuple(state[n].shape) for n in names)
    sizes = [state[n].numel() for n in names]
    offsets = tuple(int(o) for o in np.cumsum([0, *sizes[:-1]])) if names else ()
    buffer = np.empty(sum(sizes), dtype=_NUMPY_STORAGE[dtype])
    with torch.no_grad():
        for n, dst in zip(names, torch.from_numpy(buffer).view(dtype).split(sizes) if names else ()):
            dst.copy_(state[n].detach().reshape(-1))
    return FlatLoRA(buffer, names, shapes, offsets, str(dtype).removeprefix("torch."))


def flat_lora_state(unet) -> FlatLoRA:
    """The model's adapter in broadcast form, packed straight from its parameters."""
    return flatten_lora_state(lora_tensors(unet))


@torch.no_grad()
def tile_in_one_tensor(tensors: dict[str, torch.Tensor]) -> None:
    """Re-point every tensor's data at a view of ONE new contiguous tensor, back to back in dict
    order, values kept: then a flat LoRA packed in the same order loads with a single copy.

    Why: 256 small copies (SD1.5) cost ~2 ms of Python and torch dispatch per load, and far more
    when 16 samplers share a few cores; one 3 MB copy costs ~0.5 ms (and one host-to-device copy
    on a GPU instead of 256). Tensors of mixed dtypes or devices are left as they are.
    """
    ts = list(tensors.values())
    if not ts or len({(t.dtype, t.device) for t in ts}) > 1:
        return
    whole = torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype, device=ts[0].device)
    for t, part in zip(ts, whole.split([t.numel() for t in ts])):
        part.copy_(t.reshape(-1))
        t.data = part.view(t.shape)


def tile_lora_parameters(unet) -> None:
    """tile_in_one_tensor for the model's adapter (a sampler's: it only loads, never trains)."""
    tile_in_one_tensor(lora_tensors(unet))


def one_tensor_under(targets: dict[str, torch.Tensor], flat: FlatLoRA) -> torch.Tensor | None:
    """The 1-D tensor that `targets` tile in `flat`'s order and offsets (as tile_in_one_tensor
    leaves them), or None: then each tensor is copied on its own."""
    ts = [targets[n] for n in flat.names]
    if not ts:
        return None
    first = ts[0]
    start, size = first.data_ptr(), first.element_size()
    # whole-list comparisons: one Python pass each (this runs on every load)
    if [t.data_ptr() for t in ts] != [start + o * size for o in flat.offsets]:
        return None
    if not all(t.is_contiguous() and t.dtype == first.dtype for t in ts):
        return None
    # adjacent addresses alone could be separate allocations: the whole run must lie in first's storage
    if first.untyped_storage().nbytes() < (first.storage_offset() + flat.numel) * size:
        return None
    return first.detach().as_strided((flat.numel,), (1,), first.storage_offset())


@torch.no_grad()
def copy_flat_into(targets: dict[str, torch.Tensor], flat: FlatLoRA) -> None:
    """Copy a flat LoRA into `targets` in place straight from the buffer (no copy of it first):
    one copy if the targets tile one tensor in the same order, else one copy per tensor."""
    check_lora_matches(targets, flat.shapes_by_name())
    whole = one_tensor_under(targets, flat)
    if whole is not None:
        whole.copy_(_torch_view(flat.buffer).view(getattr(torch, flat.dtype)))
        return
    for n, src in flat.tensors().items():
        targets[n].copy_(src)


def load_flat_lora(unet, flat: FlatLoRA) -> None:
    """Load a broadcast (flat) LoRA into `unet` in place (exact; names and shapes must match)."""
    copy_flat_into(lora_tensors(unet), flat)


def save_lora(unet, folder: str | Path) -> Path:
    """Save the adapter so that stock diffusers loads it: `pipe.load_lora_weights(folder)`."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionPipeline.save_lora_weights(str(folder), unet_lora_layers=layers, safe_serialization=True)
    return folder
