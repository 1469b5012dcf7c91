"""What the console says when things go wrong: one line per problem, naming the thing and the fix;
resume and summary counts that add up."""
import numpy as np
import pytest

from diffrlhf.deploy.cli import one_line, resume_line
from diffrlhf.rewards import RewardContractError, as_rewards, custom_names, uses_prompts


@pytest.mark.parametrize("values, words", [
    (["good", "bad"], ["'r' returned str values ('good')", "one number per image"]),
    (["1.5", "2"], ["returned str values ('1.5')"]),  # numpy would turn these into floats silently
    ([1.0, "x"], ["returned str values"]),
    ([1.0, None], ["returned a NoneType (None)"]),
    ([b"1", b"2"], ["returned bytes"]),
    ([1.0, 2.0, 3.0], ["returned 3 values for 2 images"]),
])
def test_a_reward_that_breaks_the_contract_is_named(values, words):
    with pytest.raises(RewardContractError) as e:
        as_rewards("r", values, 2)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_numbers_of_any_kind_are_floats():
    for values in ([1, 2], np.array([1, 2], dtype=np.int64), [True, False], np.array([0.5, 1.5], dtype=np.float64),
                   [np.float16(0.5), 1]):
        out = as_rewards("r", values, 2)
        assert out.dtype == np.float32 and out.shape == (2,)
    assert as_rewards("r", [1, 2.5], 2).tolist() == [1.0, 2.5]


def test_which_rewards_read_the_prompt():
    assert not uses_prompts("jpeg_compressibility") and not uses_prompts({"name": "aesthetic"})
    assert uses_prompts("tinyworld_alignment") and uses_prompts("imagereward") and uses_prompts("my.mod:fn")
    terms = {"name": "weighted_sum", "terms": ["jpeg_compressibility", {"name": "jpeg_incompressibility", "weight": 2}]}
    assert not uses_prompts(terms)
    terms["terms"].append({"name": "tinyworld_alignment", "weight": 1})
    assert uses_prompts(terms)
    assert custom_names({"name": "weighted_sum", "terms": ["a.b:c", {"name": "jpeg_compressibility"}, {"name": "d:e", "weight": 1}]}) \
        == ["a.b:c", "d:e"]


def test_an_error_is_one_line_with_a_pointer_to_the_rest():
    assert one_line("bad thing") == "bad thing"
    # a short message keeps its hint, on the same line
    assert one_line("no weights in /x\n  fetch them with: diffrlhf fetch-weights x\n") == \
        "no weights in /x; fetch them with: diffrlhf fetch-weights x"
    # a long one (a traceback, Ray's advice) is its first line and a pointer
    long = "the learner died\n" + "\n".join(f"  File 'x.py', line {i}, in f" for i in range(20))
    assert one_line(long) == "the learner died (20 more lines with --debug)"
    assert one_line("bad\n" + "x" * 500) == "bad (1 more line with --debug)"


def test_ray_actor_death_text_is_cut_to_its_cause():
    from diffrlhf.actors.ray_errors import actor_death as _actor_death

    oom = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
           "The leased worker has unrecoverable failure. Worker is requested to be destroyed when it is returned. "
           "RPC Error message: Socket closed; \nconsider enabling resource isolation ...\nactor_id: abc")
    assert _actor_death(oom) == ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker "
                                 "exit detail: The leased worker has unrecoverable failure.")
    assert _actor_death("The actor died unexpectedly.\nadvice\nmore advice") == "The actor died unexpectedly."
    creation = ("The actor died because of an error raised in its creation task, \x1b[36mray::S.__init__()\x1b[39m (pid=1)\n"
                "  File \"w.py\", line 3, in __init__\n    raise FileNotFoundError('no weights')\n"
                "FileNotFoundError: no weights for x\nfetch them with: diffrlhf fetch-weights x")
    assert _actor_death(creation) == "FileNotFoundError: no weights for x\nfetch them with: diffrlhf fetch-weights x"
    gone = ("The actor a9b3806bb7b5849c61d8c46c01000000 is unavailable: The actor is temporarily unavailable: RpcError: RPC error: "
            "Socket closed rpc_code: 14. The task may or may not have been executed on the actor.")
    assert _actor_death(gone) == "unreachable: The actor is temporarily unavailable: RpcError: RPC error: Socket closed rpc_code: 14"


def test_resume_line_counts_what_is_made_again():
    # checkpoint after epoch 2 (3 done); epochs 3 and 4 were logged before the stop; 8 queries in flight at the checkpoint
    records = [{"epoch": e, "reward_queries": 16 * (e + 1)} for e in range(5)]
    line = resume_line({"counters": {"epochs_done": 3}, "queries_in_flight": 8}, records, epochs=10)
    assert line.startswith("resuming at epoch 3 of 10")
    assert "redone: 40 reward queries (8 of the epochs unfinished" in line and "32 of 2 epoch(s) logged after it" in line
    # a checkpoint at the last logged epoch redoes only what was in flight
    line = resume_line({"counters": {"epochs_done": 5}}, records, epochs=10)
    assert "redone: 0 reward queries" in line and "logged after it" not in line


def test_rays_own_messages_go_to_the_run_folder_without_colour(tmp_path, capsys, monkeypatch):
    """Ray's raylet messages (e.g. "A worker died ...", ~480 characters in colour when a reward actor
    dies) go to the run folder's ray_messages.log, not the console; --debug echoes them too."""
    from ray._private import worker as ray_worker

    from diffrlhf.actors.local_ray import route_ray_messages

    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)  # restored after the test
    route_ray_messages(tmp_path / "ray_messages.log")
    ray_worker.print_to_stdstream({"lines": ["\x1b[33mA worker died or was killed\x1b[0m"], "pid": "raylet", "is_err": False},
                                  ignore_prefix=False)
    assert capsys.readouterr() == ("", "")
    assert (tmp_path / "ray_messages.log").read_text() == "(raylet) A worker died or was killed\n"
    route_ray_messages(tmp_path / "again.log", echo=True)  # routing twice wraps Ray's original, not the wrapper
    ray_worker.print_to_stdstream({"lines": ["shown"], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert "shown" in capsys.readouterr().out and (tmp_path / "again.log").read_text() == "(raylet) shown\n"
    assert not (tmp_path / "ray_messages.log").read_text().count("shown")
