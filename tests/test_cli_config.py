"""Config validation, clear errors before anything starts, the watchdog, and the sample/eval commands."""
import json

import pytest
import torch
import yaml

from diffrlhf.deploy.config import ConfigError, load_config


@pytest.mark.parametrize("override, words", [
    ("train.lr=-1", ["train.lr", "-1", "> 0"]),
    ("replay.mode=foo", ["replay.mode", "foo", "hardmine"]),
    ("weighting.scheme=latent_cube", ["weighting.scheme", "latent_sq", "gaussian_mid"]),
    ("train.lrr=1", ["train.lrr", "lr"]),
    ("sample.num_steps=abc", ["sample.num_steps", "abc", "int"]),
    ("sample.eta=0", ["sample.eta", "> 0"]),
    ("train.batch_size=5", ["train.batch_size", "32"]),
    ("advantage.mode=group", ["group", "samples_per_prompt"]),
])
def test_bad_values_name_key_value_and_what_is_allowed(override, words):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides=[override])
    for w in words:
        assert w in str(e.value)


def test_overrides_and_presets():
    cfg = load_config("tiny", overrides=["train.lr=1e-3", "replay.mode=hardmine", "reward.spec={name: weighted_sum}"])
    assert cfg.train.lr == 0.001 and cfg.replay.mode == "hardmine" and cfg.reward.spec == {"name": "weighted_sum"}
    sd = load_config("sd15-ddpo")
    assert (sd.train.lr, sd.train.clip_range, sd.sample.num_steps, sd.samples_per_epoch()) == (3e-4, 1e-4, 50, 256)
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config("nope")


def test_missing_model_fails_before_ray_starts(capsys, tmp_path):
    ray = pytest.importorskip("ray")
    from diffrlhf.deploy.cli import main

    ray.shutdown()
    code = main(["train", f"model.name={tmp_path}/no-such-model", f"run.out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "no-such-model" in err and "does not exist" in err
    assert not ray.is_initialized()
    code = main(["train", "model.name=someorg/some-model", f"run.out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "local Hugging Face cache" in err and "huggingface-cli download someorg/some-model" in err
    code = main(["train", "train.clip_range=0"])
    assert code == 2 and "train.clip_range" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_a_new_run_does_not_write_into_a_folder_that_holds_one(capsys, tmp_path):
    # A fresh run named like an old one would append to its metrics and overwrite its LoRA epochs.
    ray = pytest.importorskip("ray")
    from diffrlhf.deploy.cli import main

    ray.shutdown()
    old = tmp_path / "demo"
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"epoch": 0, "reward_mean": -1.0}\n')
    code = main(["train", f"run.out_dir={tmp_path}", "run.name=demo"])
    err = capsys.readouterr().err
    assert code == 2 and "already holds a run" in err and f"--resume {old}" in err
    assert (old / "metrics.jsonl").read_text() == '{"epoch": 0, "reward_mean": -1.0}\n'
    assert not ray.is_initialized()


def test_missing_prompt_file_is_a_clear_error(tmp_path):
    from diffrlhf.policy.prompts import load_prompts

    with pytest.raises(FileNotFoundError, match="one prompt per line"):
        load_prompts(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(str(tmp_path / "empty.txt"))


def test_watchdog_flags_idle_roles_stuck_queues_and_flat_reward():
    from diffrlhf.actors.observe import Watchdog

    w = Watchdog(role_timeout_s=10, queue_timeout_s=10, flat_epochs=3)
    w.work_done("learner", now=0)
    w.waiting("learner", "epoch 3: 1/4 batches")
    w.queue("scoring", 4, capacity=4, now=0)
    assert w.check(now=5) == []
    msgs = w.check(now=20)
    assert any("learner" in m and "epoch 3: 1/4 batches" in m for m in msgs)
    assert any("scoring" in m and "full" in m for m in msgs)
    assert w.check(now=21) == []  # said once
    for r in (1.0, 1.0, 1.0):
        w.reward(r)
    assert any("not changed" in m for m in w.check(now=22))
    w.work_done("learner", now=30)
    w.queue("scoring", 2, capacity=4, now=30)
    assert w.check(now=35) == []


def run_folder(tmp_path, tiny, num_steps: int):
    """A run folder as `diffrlhf train` leaves one: config.yaml (tiny-random, small) and a LoRA epoch."""
    from diffrlhf.learner.lora import add_lora

    cfg = load_config("tiny", overrides=["model.name=tiny-random", f"sample.num_steps={num_steps}", "sample.resolution=32",
                                         "prompts.train=simple_animals", "prompts.eval=eval_simple_animals"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    add_lora(tiny.unet, rank=4)
    return run


@pytest.mark.integration  # a whole benchmark or command run: the default tier, not -m quick
def test_sample_and_eval_commands_on_a_run_folder(tmp_path, tiny):
    from diffrlhf.deploy.evaluate import cmd_eval, cmd_sample, format_table
    from diffrlhf.learner.lora import save_lora

    run = run_folder(tmp_path, tiny, num_steps=3)
    with torch.no_grad():  # a visibly non-identity adapter
        for n, p in tiny.unet.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    save_lora(tiny.unet, run / "lora" / "epoch_0001")
    grid = cmd_sample(run, "eval_simple_animals", None, n=1, which="latest")
    assert grid.exists() and grid.stat().st_size > 1000
    result = cmd_eval(run, n=1, clip=str(tmp_path / "no-clip"))
    saved = json.loads((run / "eval.json").read_text())
    assert set(saved["splits"]) == {"train", "heldout"} and saved["lora"] == "epoch_0001"
    h = saved["splits"]["heldout"]
    assert h["reward_base"] != h["reward_lora"] and h["clip_base"] is None
    assert "heldout" in format_table(result)
    with pytest.raises(FileNotFoundError, match="epoch_0001"):
        cmd_sample(run, "eval_simple_animals", None, n=1, which="epoch_0099")


# ---------------------------------------------------------------- the CLI's errors, Ctrl-C and resume (a fake driver: no Ray)


@pytest.fixture
def fake_driver(monkeypatch):
    """Replaces the Ray driver; `calls["run"]` (a function of the driver) is what its run() does."""
    from types import SimpleNamespace

    import diffrlhf.actors.driver as d

    calls = {"made": 0, "run": lambda drv: []}

    class FakeDriver:
        def __init__(self, cfg, run_dir, logger=None, progress=True, resume_state=None):
            calls["made"] += 1
            calls["resume_state"] = resume_state
            self.run_dir, self.role_stats, self.metrics = run_dir, [], SimpleNamespace(roles=lambda stats: None)

        def run(self):
            return calls["run"](self)

    monkeypatch.setattr(d, "Driver", FakeDriver)
    monkeypatch.setattr(d, "init_ray", lambda cfg: None)
    return calls


def _save(epoch):
    from diffrlhf.actors.checkpoint import save_checkpoint

    def run(drv):
        for e in range(1, epoch + 1):
            save_checkpoint(drv.run_dir, {"counters": {"epochs_done": e}, "learner": {"w": torch.ones(8) * e}})
        return []
    return run


def _tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_run_failed_is_one_clean_line_and_debug_shows_the_traceback(fake_driver, tmp_path, capsys):
    from diffrlhf.actors.driver import RunFailed
    from diffrlhf.deploy.cli import main

    def fail(drv):
        raise RunFailed("the learner actor died (OOM). Last checkpoint: x")

    fake_driver["run"] = fail
    assert main(["train", f"run.out_dir={tmp_path}", "run.name=a", "--no-progress"]) == 3
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "error: the learner actor died (OOM). Last checkpoint: x" and "Traceback" not in err
    with pytest.raises(RunFailed, match="learner actor died"):
        main(["train", f"run.out_dir={tmp_path}", "run.name=b", "--debug"])


def test_a_new_run_that_fails_before_its_first_epoch_leaves_no_folder(fake_driver, tmp_path, capsys):
    """E.g. actors that cannot be placed: the folder would hold only config.yaml and block the name.
    One that got as far as a checkpoint is kept (it can be resumed)."""
    from diffrlhf.actors.driver import RunFailed
    from diffrlhf.deploy.cli import main

    def fail(drv):
        raise RunFailed("this local Ray can never start every actor the config asks for")

    fake_driver["run"] = fail
    assert main(["train", f"run.out_dir={tmp_path}", "run.name=a", "--no-progress"]) == 3
    assert not (tmp_path / "a").exists()

    def fail_after_a_save(drv):
        _save(1)(drv)
        fail(drv)

    fake_driver["run"] = fail_after_a_save
    assert main(["train", f"run.out_dir={tmp_path}", "run.name=b", "--no-progress"]) == 3
    assert (tmp_path / "b" / "checkpoint" / "state.pt").exists() and (tmp_path / "b" / "config.yaml").exists()


def test_ctrl_c_names_the_last_checkpoint_and_the_resume_command(fake_driver, tmp_path, capsys):
    from diffrlhf.deploy.cli import main

    def interrupt_after(saves):
        def run(drv):
            _save(saves)(drv)
            raise KeyboardInterrupt
        return run

    fake_driver["run"] = interrupt_after(2)
    assert main(["train", f"run.out_dir={tmp_path}", "run.name=a"]) == 130
    err = capsys.readouterr().err
    assert f"Last checkpoint: {tmp_path / 'a' / 'checkpoint' / 'state.pt'} (2 epochs done)" in err
    assert f"diffrlhf train --resume {tmp_path / 'a'}" in err and "Traceback" not in err
    fake_driver["run"] = interrupt_after(0)
    assert main(["train", f"run.out_dir={tmp_path}", "run.name=b"]) == 130
    assert "interrupted before the first checkpoint" in capsys.readouterr().err


def test_resume_uses_the_verified_checkpoint_and_falls_back_to_the_previous(fake_driver, tmp_path, capsys):
    from diffrlhf.deploy.cli import main

    fake_driver["run"] = _save(2)
    assert main(["train", f"run.out_dir={tmp_path}", "run.name=a", "run.tensorboard=false"]) == 0
    assert fake_driver["resume_state"] is None
    run = tmp_path / "a"
    fake_driver["run"] = lambda drv: []
    assert main(["train", "--resume", str(run)]) == 0
    assert fake_driver["resume_state"]["counters"]["epochs_done"] == 2
    state = run / "checkpoint" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0
    assert fake_driver["resume_state"]["counters"]["epochs_done"] == 1
    err = capsys.readouterr().err
    assert str(state) in err and str(run / "checkpoint.prev" / "state.pt") in err


def test_a_failed_resume_changes_nothing_in_the_run_folder(fake_driver, tmp_path, capsys):
    from diffrlhf.deploy.cli import main

    fake_driver["run"] = _save(1)  # one save: no previous checkpoint to fall back to
    assert main(["train", f"run.out_dir={tmp_path}", "run.name=a", "train.epochs=1"]) == 0
    run = tmp_path / "a"
    state = run / "checkpoint" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated
    tree, config, made = _tree(run), (run / "config.yaml").read_bytes(), fake_driver["made"]
    assert any(p.startswith("tb/") for p in tree)
    code = main(["train", "--resume", str(run), "train.epochs=5"])  # an override would rewrite config.yaml
    err = capsys.readouterr().err
    assert code == 4 and any(line.startswith("error: no usable checkpoint") for line in err.splitlines()) and str(state) in err and "Traceback" not in err
    assert _tree(run) == tree and (run / "config.yaml").read_bytes() == config and fake_driver["made"] == made
    assert main(["train", "--resume", str(tmp_path / "nope")]) == 2
    assert "no config.yaml there" in capsys.readouterr().err


def test_help_lists_the_exit_codes(capsys):
    from diffrlhf.deploy.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "exit codes" in out and "130" in out and "--debug" in out and "--resume" in out


def test_yaml_boolean_words_stay_words_for_string_keys():
    """YAML 1.1 reads off/on/yes/no as booleans; on the command line `recast.mode=off` is the word."""
    assert load_config("tiny", overrides=["recast.mode=off"]).recast.mode == "off"
    assert load_config("tiny", overrides=["system.colocate=false"]).system.colocate is False
    with pytest.raises(ConfigError, match="system.colocate"):
        load_config("tiny", overrides=["system.colocate=no"])  # a bool key takes true/false, said by name


def test_a_resume_keeps_the_runs_config_and_writes_its_overrides_beside_it(tmp_path):
    """config.yaml stays as the run started; each resume's overrides go to resumes.yaml, and a later
    resume applies them in order before its own."""
    import argparse

    from diffrlhf.deploy.cli import load_cfg
    from diffrlhf.deploy.runlog import RunLogger

    run = tmp_path / "r"
    RunLogger(run, load_config("tiny", overrides=["train.epochs=2"]), tensorboard=False)
    started = (run / "config.yaml").read_bytes()
    args = argparse.Namespace(resume=str(run), overrides=["train.epochs=4"])
    cfg = load_cfg(args)
    RunLogger(run, cfg, tensorboard=False, resume_overrides=args.overrides)
    assert (run / "config.yaml").read_bytes() == started and cfg.train.epochs == 4
    assert [e["overrides"] for e in yaml.safe_load((run / "resumes.yaml").read_text())] == [["train.epochs=4"]]
    again = load_cfg(argparse.Namespace(resume=str(run), overrides=[]))  # the earlier resume's override still holds
    assert again.train.epochs == 4 and (again.run.out_dir, again.run.name) == (str(tmp_path), "r")
    assert load_cfg(argparse.Namespace(resume=str(run), overrides=["train.epochs=6"])).train.epochs == 6


@pytest.mark.integration
def test_eval_prints_only_what_was_asked_aligned(tmp_path, tiny):
    """No library chatter (progress bars, transformers' torchvision note, diffusers' FutureWarning,
    "No LoRA keys"), the missing CLIP said once, the table's columns aligned."""
    import subprocess
    import sys

    from diffrlhf.learner.lora import save_lora

    run = run_folder(tmp_path, tiny, num_steps=2)
    save_lora(tiny.unet, run / "lora" / "epoch_0001")
    # eval loads everything sample does (the pipeline, the LoRA) and more (CLIP, the reward): one process
    for args in (["eval", "--run", str(run), "--n", "1", "--clip", str(tmp_path / "no-clip")],):
        done = subprocess.run([sys.executable, "-m", "diffrlhf.deploy.cli", *args], capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
        out = done.stdout.splitlines()
        assert sum("CLIP score skipped" in ln for ln in out) == 1
        table = [ln for ln in out if "|" in ln]
        assert len(table) == 4 and len({tuple(i for i, c in enumerate(ln) if c == "|") for ln in table}) == 1, table


def test_the_summary_says_the_queries_paid_for_beside_the_trained_ones(capsys, tmp_path):
    """Issue 54 item 2: after a stop and resume, the queries answered in all (re-done ones included)
    are said beside the trained epochs' count, which stays the sample-efficiency axis."""
    from diffrlhf.deploy.cli import _summary

    cfg = load_config("tiny", overrides=["train.lr=0.02"])  # no committed band for this config
    recs = [{"epoch": 0, "reward_mean": -1.9, "reward_se": 0.03, "reward_queries": 32, "reward_queries_total": 32, "reward_queries_lost": 0},
            {"epoch": 1, "reward_mean": -1.8, "reward_se": 0.03, "reward_queries": 64, "reward_queries_total": 80, "reward_queries_lost": 16}]
    _summary(cfg, recs, 10.0, tmp_path, [])
    out = capsys.readouterr().out
    assert "over 64 reward queries (80 answered in all, 16 of them re-done after a stop)" in out
    recs[1].update(reward_queries_total=64, reward_queries_lost=0)
    _summary(cfg, recs, 10.0, tmp_path, [])
    assert "over 64 reward queries\n" in capsys.readouterr().out
