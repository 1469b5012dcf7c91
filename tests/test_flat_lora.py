"""The learner's broadcast form: one contiguous buffer per policy version (learner/lora.py FlatLoRA)."""
import warnings

import numpy as np
import pytest
import torch

from diffrlhf.learner.lora import (FlatLoRA, add_lora, copy_flat_into, flat_lora_state, flatten_lora_state, load_flat_lora,
                                   load_lora_state_dict, lora_state_dict, lora_tensors, one_tensor_under, tile_in_one_tensor,
                                   tile_lora_parameters)

MIXED_SHAPES = {"a.lora_A.weight": (4, 8), "a.lora_B.weight": (16, 4), "bias": (3,), "cube": (2, 3, 5), "scalar": ()}


def random_state(shapes: dict, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits: equal bits is bit-exact (also for NaN and -0.0)."""
    return t.reshape(-1).contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_bit_exact_and_the_buffer_is_one_contiguous_array(dtype):
    state = random_state(MIXED_SHAPES, dtype)
    state["bias"][0] = -0.0
    flat = flatten_lora_state(state)
    assert isinstance(flat.buffer, np.ndarray) and flat.buffer.ndim == 1 and flat.buffer.flags.c_contiguous
    assert flat.numel == flat.buffer.size == sum(t.numel() for t in state.values()) == 4 * 8 + 16 * 4 + 3 + 30 + 1
    assert flat.dtype == str(dtype).removeprefix("torch.") and flat.names == tuple(MIXED_SHAPES)
    back = flat.to_state_dict()
    assert list(back) == list(state)
    for n, t in state.items():
        assert back[n].dtype == dtype and back[n].shape == t.shape and torch.equal(bits(back[n]), bits(t)), n
    # the dict form owns its memory: writing into it leaves the buffer (maybe a store's) alone
    before = flat.buffer.copy()
    for t in back.values():
        t.fill_(7)
    assert np.array_equal(flat.buffer.view(np.uint8), before.view(np.uint8))


def test_one_dtype_per_buffer():
    with pytest.raises(ValueError, match="mixes"):
        flatten_lora_state({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.float16)})


def test_flat_load_into_a_lora_unet_equals_the_dict_load(tiny):
    add_lora(tiny.unet, rank=4)
    state = random_state({n: tuple(p.shape) for n, p in lora_tensors(tiny.unet).items()}, seed=1)

    load_lora_state_dict(tiny.unet, state)
    from_dict = lora_state_dict(tiny.unet)
    for p in lora_tensors(tiny.unet).values():
        p.data.zero_()
    load_flat_lora(tiny.unet, flatten_lora_state(state))
    from_flat = lora_state_dict(tiny.unet)

    assert list(from_flat) == list(from_dict) == list(state)
    assert all(torch.equal(bits(from_flat[n]), bits(from_dict[n])) and torch.equal(from_flat[n], state[n]) for n in state)
    # the learner's broadcast packs straight from the parameters
    again = flat_lora_state(tiny.unet).to_state_dict()
    assert all(torch.equal(again[n], state[n]) for n in state)


def unet_output(unet) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    c = unet.config
    x = torch.randn(1, c.in_channels, c.sample_size, c.sample_size, generator=g)
    with torch.no_grad():
        return unet(x, 500, encoder_hidden_states=torch.randn(1, 7, c.cross_attention_dim, generator=g)).sample


def test_a_sampler_lora_tiled_in_one_tensor_loads_with_one_copy_and_samples_the_same(tiny):
    """What SamplerWorker does: tile_lora_parameters, then every new version is one copy."""
    add_lora(tiny.unet, rank=4)
    state = random_state({n: tuple(p.shape) for n, p in lora_tensors(tiny.unet).items()}, seed=3)
    load_lora_state_dict(tiny.unet, state)
    before = unet_output(tiny.unet)

    tile_lora_parameters(tiny.unet)
    params = lora_tensors(tiny.unet)
    assert len({p.untyped_storage().data_ptr() for p in params.values()}) == 1  # one tensor under all
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in params.values())
    assert torch.equal(unet_output(tiny.unet), before)  # same values, same model

    flat = flatten_lora_state(random_state({n: tuple(p.shape) for n, p in params.items()}, seed=4))
    assert one_tensor_under(params, flat) is not None  # the single-copy path
    load_flat_lora(tiny.unet, flat)
    assert all(torch.equal(bits(p), bits(flat.to_state_dict()[n])) for n, p in lora_tensors(tiny.unet).items())
    load_flat_lora(tiny.unet, flatten_lora_state(state))  # and back: the first model again, bit for bit
    assert torch.equal(unet_output(tiny.unet), before)


def test_a_flat_in_another_order_loads_tensor_by_tensor():
    state = random_state(MIXED_SHAPES, seed=5)
    targets = {n: torch.zeros(s) for n, s in MIXED_SHAPES.items()}
    tile_in_one_tensor(targets)
    reordered = flatten_lora_state(dict(reversed(list(state.items()))))
    assert one_tensor_under(targets, reordered) is None and one_tensor_under(targets, flatten_lora_state(state)) is not None
    copy_flat_into(targets, reordered)
    assert all(torch.equal(bits(targets[n]), bits(state[n])) for n in state)
    # separate tensors (not tiled) also load exactly, one copy each
    separate = {n: torch.zeros(s) for n, s in MIXED_SHAPES.items()}
    assert one_tensor_under(separate, flatten_lora_state(state)) is None
    copy_flat_into(separate, flatten_lora_state(state))
    assert all(torch.equal(bits(separate[n]), bits(state[n])) for n in state)


def test_a_name_or_shape_mismatch_raises_naming_the_tensor(tiny):
    add_lora(tiny.unet, rank=4)
    state = lora_state_dict(tiny.unet)
    name = next(iter(state))

    wrong_shape = dict(state)
    wrong_shape[name] = torch.zeros(wrong_shape[name].shape[0], wrong_shape[name].shape[1] + 1)
    with pytest.raises(ValueError, match=rf"LoRA tensor {name} has shape"):
        load_flat_lora(tiny.unet, flatten_lora_state(wrong_shape))
    with pytest.raises(ValueError, match=rf"LoRA tensor {name} has shape"):
        load_lora_state_dict(tiny.unet, wrong_shape)

    renamed = {("x" + n if n == name else n): t for n, t in state.items()}
    with pytest.raises(KeyError, match=rf"missing \['{name}'\].*unknown \['x{name}'\]"):
        load_flat_lora(tiny.unet, flatten_lora_state(renamed))
    missing = {n: t for n, t in state.items() if n != name}
    with pytest.raises(KeyError, match=rf"missing \['{name}'\]"):
        load_flat_lora(tiny.unet, flatten_lora_state(missing))


@pytest.mark.integration
def test_ray_round_trip_is_zero_copy_and_loads_exactly():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        # SD1.5-like sizes, well above Ray's inline limit (100 KiB) so the object lives in the shared store
        shapes = {f"b{i}.lora_A.weight": (4, 320 + 64 * i) for i in range(8)} | {f"b{i}.lora_B.weight": (640, 4) for i in range(8)}
        state = random_state(shapes, seed=2)
        ref = ray.put((3, flatten_lora_state(state)))
        version, got = ray.get(ref)
        _, again = ray.get(ref)
        assert version == 3 and isinstance(got, FlatLoRA)
        # a read-only view of the store's memory, the same memory on every get: nothing was copied
        assert not got.buffer.flags.writeable and not got.buffer.flags.owndata
        assert got.buffer.ctypes.data == again.buffer.ctypes.data
        separate = {n: torch.empty(s) for n, s in shapes.items()}
        tiled = {n: torch.empty(s) for n, s in shapes.items()}
        tile_in_one_tensor(tiled)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # reading the read-only buffer warns about nothing
            copy_flat_into(separate, got)
            copy_flat_into(tiled, got)
        assert all(torch.equal(bits(separate[n]), bits(state[n])) and torch.equal(bits(tiled[n]), bits(state[n])) for n in state)
        assert np.array_equal(got.buffer, flatten_lora_state(state).buffer)  # the store's bytes are untouched

        @ray.remote(num_cpus=0)
        def flags_in_a_worker(weights):  # what a sampler actor sees when Ray resolves the reference
            buf = weights[1].buffer
            return buf.flags.writeable, buf.flags.owndata, float(weights[1].to_state_dict()["b7.lora_B.weight"].sum())

        writeable, owndata, total = ray.get(flags_in_a_worker.remote(ref))
        assert not writeable and not owndata and total == float(state["b7.lora_B.weight"].sum())
        del got, again, ref
    finally:
        if started:
            ray.shutdown()
