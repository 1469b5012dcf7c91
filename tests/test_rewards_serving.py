"""RewardServer: chunking, rewards keyed by id, exact query counting, NaN/inf policy."""

import numpy as np
import pytest

from diffrlhf.rewards import NonFiniteRewardError
from diffrlhf.rewards.serving import RewardServer, ScoreResult


class Recorder:
    """Reward = first pixel value of the image (so we know which image produced which value);
    images whose first pixel is 0 / 1 give NaN / inf."""

    name = "recorder"

    def __init__(self):
        self.calls = []

    def __call__(self, images, prompts):
        self.calls.append(len(images))
        v = images[:, 0, 0, 0].astype(np.float32)
        v[v == 0] = np.nan
        v[v == 1] = np.inf
        return v


def imgs(values):
    out = np.zeros((len(values), 4, 4, 3), np.uint8)
    out[:, 0, 0, 0] = values
    return out


def test_chunks_and_keys():
    rec = Recorder()
    srv = RewardServer(rec, batch_size=3)
    ids = [10, 11, 12, 13, 14, 15, 16]
    res = srv.score(ids, imgs([20, 21, 22, 23, 24, 25, 26]), [f"p{i}" for i in ids])
    assert isinstance(res, ScoreResult)
    assert rec.calls == [3, 3, 1]
    assert res.ids == ids and res.rewards.dtype == np.float32
    assert res.as_dict() == {i: float(i + 10) for i in ids}
    assert res.dropped_ids == [] and srv.num_queries == 7 and srv.num_calls == 3


def test_rescoring_same_id_is_not_counted_twice():
    srv = RewardServer(Recorder(), batch_size=8)
    srv.score([0, 1, 2], imgs([5, 6, 7]), ["a"] * 3)
    srv.score([2, 3], imgs([7, 8]), ["a"] * 2)
    srv.score([0, 0], imgs([5, 5]), ["a"] * 2)
    assert srv.num_queries == 4


def test_nan_raises_with_reward_prompt_and_id():
    srv = RewardServer(Recorder(), batch_size=2)
    with pytest.raises(NonFiniteRewardError) as ei:
        srv.score([7, 8, 9], imgs([5, 0, 6]), ["ok", "the bad prompt", "later"])
    msg = str(ei.value)
    assert "recorder" in msg and "the bad prompt" in msg and "8" in msg and "nan" in msg
    assert ei.value.sample_id == 8
    assert srv.num_queries == 2  # the chunk [7, 8] was scored before the error


def test_inf_raises_too():
    with pytest.raises(NonFiniteRewardError, match="inf"):
        RewardServer(Recorder()).score([1], imgs([1]), ["x"])


def test_drop_policy():
    srv = RewardServer(Recorder(), nan_policy="drop", batch_size=2)
    res = srv.score([1, 2, 3, 4, 5], imgs([9, 0, 8, 1, 7]), list("abcde"))
    assert res.ids == [1, 3, 5] and res.rewards.tolist() == [9.0, 8.0, 7.0]
    assert res.dropped_ids == [2, 4]
    assert srv.num_dropped == 2 and srv.num_queries == 5
    srv.score([2], imgs([0]), ["b"])  # same id dropped again: counted once
    assert srv.num_dropped == 2 and srv.num_queries == 5


def test_by_spec_and_validation():
    srv = RewardServer("jpeg_incompressibility", batch_size=4)
    ims = np.random.RandomState(0).randint(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    res = srv.score(list(range(5)), ims, [""] * 5)
    assert res.rewards.shape == (5,) and (res.rewards > 0).all()
    assert srv.stats()["reward"] == "jpeg_incompressibility" and srv.stats()["num_queries"] == 5
    with pytest.raises(ValueError, match="ids"):
        srv.score([1, 2], ims, [""] * 5)
    with pytest.raises(ValueError, match="nan_policy"):
        RewardServer("jpeg_compressibility", nan_policy="ignore")


def test_error_pickles_for_ray():
    import pickle

    from diffrlhf.rewards import MissingWeightsError

    e = pickle.loads(pickle.dumps(NonFiniteRewardError("r", 3, "p", float("nan"))))
    assert e.sample_id == 3 and "'p'" in str(e)
    m = pickle.loads(pickle.dumps(MissingWeightsError("aesthetic", "f.pth", ["/a"])))
    assert "f.pth" in str(m) and "/a" in str(m) and isinstance(m, FileNotFoundError)
