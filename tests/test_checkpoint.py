"""Checkpoints survive damage and crashes: a verified load, a kept previous one, an atomic rotation."""
import json
from pathlib import Path

import pytest
import torch

from diffrlhf.actors.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint


def state(epoch: int) -> dict:
    return {"learner": {"w": torch.full((64, 64), float(epoch))}, "counters": {"epochs_done": epoch}}


def epochs(s: dict) -> int:
    return s["counters"]["epochs_done"]


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_save_keeps_the_previous_checkpoint_and_a_manifest(tmp_path):
    assert save_checkpoint(tmp_path, state(1)) == tmp_path / "checkpoint" / "state.pt"
    save_checkpoint(tmp_path, state(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint.prev"]
    m = json.loads((tmp_path / "checkpoint" / "manifest.json").read_text())
    assert m["epochs_done"] == 2 and m["bytes"] == (tmp_path / "checkpoint" / "state.pt").stat().st_size
    loaded = load_checkpoint(tmp_path)
    assert epochs(loaded) == 2 and torch.equal(loaded["learner"]["w"], state(2)["learner"]["w"])
    assert epochs(torch.load(tmp_path / "checkpoint.prev" / "state.pt", weights_only=False)) == 1
    assert latest_checkpoint(tmp_path) == (tmp_path / "checkpoint" / "state.pt", 2)


@pytest.mark.parametrize("damage", ["truncate", "flip_a_byte", "delete"])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    save_checkpoint(tmp_path, state(1))
    save_checkpoint(tmp_path, state(2))
    path = tmp_path / "checkpoint" / "state.pt"
    if damage == "truncate":
        truncate(path)
    elif damage == "flip_a_byte":  # same size: only the sha256 tells
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    messages = []
    assert epochs(load_checkpoint(tmp_path, log=messages.append)) == 1
    assert len(messages) == 1 and str(path) in messages[0] and str(tmp_path / "checkpoint.prev" / "state.pt") in messages[0]
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # a load changes nothing


def test_torch_must_read_it_too(tmp_path):
    # No manifest (a run saved before manifests): an unreadable file is still caught, by torch.load.
    save_checkpoint(tmp_path, state(1))
    save_checkpoint(tmp_path, state(2))
    (tmp_path / "checkpoint" / "manifest.json").unlink()
    truncate(tmp_path / "checkpoint" / "state.pt")
    messages = []
    assert epochs(load_checkpoint(tmp_path, log=messages.append)) == 1
    assert "torch cannot read" in messages[0]


def test_both_damaged_is_a_checkpoint_error_naming_both(tmp_path):
    save_checkpoint(tmp_path, state(1))
    save_checkpoint(tmp_path, state(2))
    truncate(tmp_path / "checkpoint" / "state.pt")
    truncate(tmp_path / "checkpoint.prev" / "state.pt")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "checkpoint" / "state.pt") in msg and str(tmp_path / "checkpoint.prev" / "state.pt") in msg
    assert "start a new run" in msg
    with pytest.raises(CheckpointError, match="before its first save"):
        load_checkpoint(tmp_path / "empty")


def _crash_on_rename(monkeypatch, nth: int):
    """Make the nth Path.rename of the next save raise, as a crash at that point would stop it."""
    real, calls = Path.rename, []

    def rename(self, target):
        calls.append(self)
        if len(calls) == nth:
            raise OSError("simulated crash")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)


def test_a_crash_before_the_rotation_keeps_the_current_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, state(1))
    save_checkpoint(tmp_path, state(2))
    _crash_on_rename(monkeypatch, 1)  # tmp written, checkpoint/ not yet moved
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path, state(3))
    monkeypatch.undo()
    assert (tmp_path / "checkpoint.tmp" / "state.pt").exists()
    assert epochs(load_checkpoint(tmp_path)) == 2
    save_checkpoint(tmp_path, state(4))  # the next save goes on normally
    assert epochs(load_checkpoint(tmp_path)) == 4 and not (tmp_path / "checkpoint.tmp").exists()


def test_a_crash_between_the_renames_leaves_a_loadable_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, state(1))
    save_checkpoint(tmp_path, state(2))
    _crash_on_rename(monkeypatch, 2)  # checkpoint/ moved to checkpoint.prev/, tmp not renamed
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path, state(3))
    monkeypatch.undo()
    assert not (tmp_path / "checkpoint").exists()
    assert epochs(load_checkpoint(tmp_path)) == 3  # the complete, verified tmp is the newest
    assert latest_checkpoint(tmp_path) == (tmp_path / "checkpoint.tmp" / "state.pt", 3)
    (tmp_path / "checkpoint.tmp" / "manifest.json").unlink()  # a tmp without its manifest is incomplete
    assert epochs(load_checkpoint(tmp_path)) == 2
    save_checkpoint(tmp_path, state(4))
    assert epochs(load_checkpoint(tmp_path)) == 4
    assert epochs(torch.load(tmp_path / "checkpoint.prev" / "state.pt", weights_only=False)) == 2


def test_saving_over_a_damaged_checkpoint_keeps_the_good_previous_one(tmp_path):
    save_checkpoint(tmp_path, state(1))
    save_checkpoint(tmp_path, state(2))
    truncate(tmp_path / "checkpoint" / "state.pt")
    save_checkpoint(tmp_path, state(3))
    assert epochs(load_checkpoint(tmp_path)) == 3
    assert epochs(torch.load(tmp_path / "checkpoint.prev" / "state.pt", weights_only=False)) == 1


def test_bytes_are_saved_as_they_are_and_the_manifest_names_the_format(tmp_path):
    """Format 2: the buffer's Arrow batches (bytes) take their own size on disk, not 1.5x (format 1,
    torch.save's default protocol 2, wrote them as latin-1 text)."""
    from diffrlhf.actors.checkpoint import FORMAT

    blob = bytes(range(256)) * 4096  # 1 MiB, half of it bytes >= 0x80
    path = save_checkpoint(tmp_path, {"buffer": {"epochs": {0: blob}}, "counters": {"epochs_done": 1}})
    assert path.stat().st_size < 1.05 * len(blob)
    assert json.loads((tmp_path / "checkpoint" / "manifest.json").read_text())["format"] == FORMAT == 2
    assert load_checkpoint(tmp_path)["buffer"]["epochs"][0] == blob


def test_a_format_1_checkpoint_still_loads(tmp_path):
    """Written as before format 2: protocol 2, a manifest without a format."""
    import hashlib

    folder = tmp_path / "checkpoint"
    folder.mkdir()
    torch.save(state(3), folder / "state.pt", pickle_protocol=2)
    data = (folder / "state.pt").read_bytes()
    (folder / "manifest.json").write_text(json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "epochs_done": 3}))
    assert epochs(load_checkpoint(tmp_path)) == 3


def test_a_newer_format_is_refused_naming_both_formats(tmp_path):
    save_checkpoint(tmp_path, state(1))
    m = tmp_path / "checkpoint" / "manifest.json"
    m.write_text(json.dumps({**json.loads(m.read_text()), "format": 3}))
    with pytest.raises(CheckpointError, match=r"checkpoint format 3, newer than this diffrlhf reads \(formats 1 to 2\): upgrade diffrlhf"):
        load_checkpoint(tmp_path)
