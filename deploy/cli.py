"""The `diffrlhf` command.

    diffrlhf train [--preset tiny] [--config FILE] [--resume RUN_DIR] [key.sub=value ...]
    diffrlhf reference [...]            the single-process reference loop (same options)
    diffrlhf sample --run RUN_DIR --prompts FILE   images of the trained LoRA beside the base model's (a grid)
    diffrlhf eval --run RUN_DIR         reward on train and held-out prompts (+ CLIP score if CLIP weights exist)
    diffrlhf fetch-weights NAME         download a reward model's weights (needs internet)
    diffrlhf presets                    list presets
    diffrlhf base-model [--out DIR]     the embedded model as a standard diffusers folder (for a stock pipeline)

Under `ray job submit` (RAY_ADDRESS set) `train` joins the cluster; otherwise it starts a local Ray.
Bad input (config keys, reward spec and weights, prompt lists, the model) is an error before any
run folder is made or Ray starts.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import yaml

EXIT_INPUT, EXIT_RUN_FAILED, EXIT_CHECKPOINT, EXIT_INTERRUPTED = 2, 3, 4, 130
EXIT_CODES = f"""exit codes:
  0    done
  {EXIT_INPUT}    bad config or input (config key, reward spec or weights, prompt list, model, run folder): nothing started
  {EXIT_RUN_FAILED}    the run failed (a learner or buffer dead past system.max_core_restarts, a failing reward, no progress); it names the last checkpoint
  {EXIT_CHECKPOINT}    --resume found no usable checkpoint (each path tried is named); the run folder is unchanged
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C); it prints the command that resumes from the last checkpoint
Errors are one line `error: ...`; --debug shows the whole message and the traceback instead."""


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help="preset name (deploy/presets/*.yaml); default: tiny, the embedded default")
    p.add_argument("--config", help="a YAML file with config sections, applied over the preset")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=0.001 replay.mode=hardmine")


def load_cfg(args):
    from diffrlhf.deploy.config import apply_overrides, config_from_dict, load_config, parse_override, validate
    from diffrlhf.deploy.preflight import InputError
    from diffrlhf.deploy.runlog import resume_overrides

    if getattr(args, "resume", None):

        path = Path(args.resume) / "config.yaml"
        if not path.exists():
            raise InputError(f"--resume {args.resume}: no config.yaml there; give a run folder (runs/<name>)")
        cfg = config_from_dict(yaml.safe_load(path.read_text()))
        for o in [*(o for earlier in resume_overrides(args.resume) for o in earlier), *args.overrides]:
            apply_overrides(cfg, parse_override(o))  # config.yaml as the run started, then each resume's overrides
        cfg = validate(cfg)
        cfg.run.out_dir, cfg.run.name = str(Path(args.resume).parent), Path(args.resume).name
        return cfg
    return load_config(args.preset, args.config, args.overrides)


def preflight(cfg) -> None:
    """Every input checked before a run folder or Ray exists; warnings are said once, here."""
    from diffrlhf.deploy.preflight import check_run_inputs

    for w in check_run_inputs(cfg):
        print(f"[diffrlhf] warning: {w}", file=sys.stderr)


def cmd_train(args) -> int:
    from diffrlhf.actors.checkpoint import load_checkpoint
    from diffrlhf.actors.driver import Driver, RunFailed, init_ray
    from diffrlhf.actors.local_ray import route_ray_messages
    from diffrlhf.deploy.runlog import RunLogger, make_run_dir

    cfg = load_cfg(args)
    preflight(cfg)
    # A resume is verified before RunLogger records its overrides and opens tb/: a failed one changes nothing.
    state = load_checkpoint(args.resume) if args.resume else None
    run_dir = Path(args.resume) if args.resume else make_run_dir(cfg)
    logger = RunLogger(run_dir, cfg, tensorboard=cfg.run.tensorboard, resume_overrides=list(args.overrides) if args.resume else None)
    print(f"[diffrlhf] run folder: {run_dir}")
    if state is not None:
        print(f"[diffrlhf] {resume_line(state, logger.records, cfg.train.epochs)}")
    t0 = time.time()
    try:
        init_ray(cfg)
        route_ray_messages(run_dir / "ray_messages.log", echo=args.debug)  # the driver says each event in one line
        driver = Driver(cfg, run_dir, logger=logger, progress=not args.no_progress, resume_state=state)
        records = driver.run()
    except RunFailed:
        if not args.resume:
            _discard_if_unused(run_dir, logger)
        raise
    except KeyboardInterrupt:
        _interrupted(run_dir)
        if args.debug:
            raise
        return EXIT_INTERRUPTED
    finally:
        logger.close()
    wall = time.time() - t0
    (run_dir / "roles.json").write_text(json.dumps(driver.role_stats, indent=1))
    driver.metrics.roles(driver.role_stats)
    logger.plot_reward_curve()
    logger.plot_reward_terms()
    # The whole run's records (a resumed run's earlier epochs too): the gain is from epoch 0.
    _summary(cfg, logger.records, wall, run_dir, driver.role_stats, this_session=len(records))
    return 0


def resume_line(state: dict, records: list[dict], epochs: int) -> str:
    """Where a resume continues and what it makes again: every epoch after the checkpoint is sampled
    and scored anew, so the queries made for them before the stop are redone."""
    done = int(state["counters"]["epochs_done"])
    in_flight = int(state.get("queries_in_flight", 0))  # unfinished at the checkpoint: counted as reward_queries_lost
    past = [r for r in records if r["epoch"] >= done]  # trained after the checkpoint, before the stop
    before = max((r["reward_queries"] for r in records if r["epoch"] < done), default=0)
    redo = (max(r["reward_queries"] for r in past) - before) if past else 0
    after = f" and {redo} of {len(past)} epoch(s) logged after it" if past else ""
    return (f"resuming at epoch {done} of {epochs} from the checkpoint; redone: {in_flight + redo} reward queries "
            f"({in_flight} of the epochs unfinished at the checkpoint, in reward_queries_total and reward_queries_lost{after}), "
            "besides any the stop interrupted after the checkpoint")


def _discard_if_unused(run_dir: Path, logger) -> None:
    """A new run that failed before its first epoch (say, actors that cannot be placed) leaves no
    folder behind: it would hold only config.yaml and an empty tb/, and block the run name."""
    if not any((run_dir / f).exists() for f in ("metrics.jsonl", "checkpoint", "checkpoint.prev", "checkpoint.tmp", "lora")):
        logger.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def cmd_reference(args) -> int:
    from diffrlhf.actors.reference_loop import run_reference
    from diffrlhf.deploy.runlog import RunLogger, make_run_dir

    cfg = load_cfg(args)
    preflight(cfg)
    run_dir = make_run_dir(cfg)
    logger = RunLogger(run_dir, cfg, tensorboard=cfg.run.tensorboard)
    t0 = time.time()
    records = run_reference(cfg, logger=logger, progress=not args.no_progress)
    logger.plot_reward_curve()
    logger.plot_reward_terms()
    logger.close()
    _summary(cfg, records, time.time() - t0, run_dir, [])
    return 0


def _interrupted(run_dir: Path) -> None:
    from diffrlhf.actors.checkpoint import latest_checkpoint

    last = latest_checkpoint(run_dir)
    if last is None:
        print(f"\n[diffrlhf] interrupted before the first checkpoint; nothing to resume in {run_dir} "
              "(start a new run; the folder can be deleted)", file=sys.stderr)
        return
    path, epochs = last
    done = f" ({epochs} epochs done)" if epochs is not None else ""
    print(f"\n[diffrlhf] interrupted. Last checkpoint: {path}{done}. Continue with:\n"
          f"  diffrlhf train --resume {shlex.quote(str(run_dir))}", file=sys.stderr)


def _exit_code(e: BaseException) -> int | None:
    """The exit code of an error the CLI reports in one line; None for a bug (shown with its traceback)."""
    from diffrlhf.deploy.config import ConfigError
    from diffrlhf.deploy.preflight import InputError

    if isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(e, (ConfigError, InputError, FileNotFoundError, FileExistsError)):  # ModelNotFoundError, MissingWeightsError too
        return EXIT_INPUT
    from diffrlhf.actors.checkpoint import CheckpointError
    from diffrlhf.actors.driver import RunFailed
    from diffrlhf.rewards import NonFiniteRewardError

    if isinstance(e, CheckpointError):
        return EXIT_CHECKPOINT
    if isinstance(e, (RunFailed, NonFiniteRewardError)):
        return EXIT_RUN_FAILED
    from diffrlhf.rewards.environments import RewardEnvError

    if isinstance(e, RewardEnvError):
        return EXIT_INPUT
    return None


def _summary(cfg, records, wall, run_dir, roles, this_session: int | None = None) -> None:
    from diffrlhf.deploy.baseline import ddpo_band, summary_line

    if records:
        a, b = records[0], records[-1]
        resumed = f" ({this_session} after the resume)" if this_session is not None and this_session < len(records) else ""
        total, redone = b.get("reward_queries_total", b["reward_queries"]), b.get("reward_queries_lost", 0)
        paid = f" ({total} answered in all, {redone} of them re-done after a stop)" if redone or total != b["reward_queries"] else ""
        print(f"[diffrlhf] {len(records)} epochs{resumed} in {wall:.1f}s; reward {a['reward_mean']:.4f} -> {b['reward_mean']:.4f} "
              f"over {b['reward_queries']} reward queries{paid}")
        line = summary_line(records, ddpo_band(cfg))  # the gain in standard errors, beside DDPO's committed band
        if line:
            print(f"[diffrlhf] {line}")
    for r in roles:
        if "idle_fraction" in r:
            print(f"[diffrlhf]   {r['role']:<10} busy {r['busy_s']:7.1f}s  idle {100 * r['idle_fraction']:5.1f}%")
    print(f"[diffrlhf] metrics: {run_dir / 'metrics.jsonl'}  curve: {run_dir / 'reward_curve.png'}  LoRA: {run_dir / 'lora'}")


def cmd_sample(args) -> int:
    from diffrlhf.deploy.evaluate import cmd_sample as sample

    path = sample(args.run, args.prompts, args.out, args.n, args.lora)
    print(f"[diffrlhf] grid (rows: base, then LoRA on the same noise): {path}")
    return 0


def cmd_eval(args) -> int:
    from diffrlhf.deploy.evaluate import cmd_eval as evaluate
    from diffrlhf.deploy.evaluate import format_table

    result = evaluate(args.run, args.lora, args.n, args.clip, args.out)
    print(format_table(result))
    print(f"[diffrlhf] results: {result['path']}")
    return 0


def cmd_fetch_weights(args) -> int:
    from diffrlhf.rewards.fetch import main as fetch_main

    return fetch_main([args.name] + (["--dest", args.dest] if args.dest else []) + ["--version", args.version])


def cmd_config(args) -> int:
    from diffrlhf.deploy.config import keys_table, resolve_config, show_config

    if args.action == "keys":
        print(keys_table(), end="")
        return 0
    print(show_config(*resolve_config(args.preset, args.config, args.overrides)), end="")
    return 0


def cmd_reward_env(args) -> int:
    from diffrlhf.rewards import environments

    if args.action == "build":
        environments.build(args.name, torch_version=args.torch)
        print(environments.env_dir(args.name))
        return 0
    print(environments.check(args.name))  # `check`: the venv's python, or the one-line reason it is not usable
    return 0


def cmd_presets(args) -> int:
    from diffrlhf.deploy.config import presets

    print("\n".join(presets()))
    return 0


def cmd_base_model(args) -> int:
    """The embedded model as a folder stock diffusers loads (StableDiffusionPipeline.from_pretrained),
    to load a trained LoRA onto. The package carries it compactly; this writes the standard form."""
    from diffrlhf.tinyworld.weights import ensure_tiny_world

    folder = ensure_tiny_world()
    if args.out:
        out = Path(args.out)
        if out.exists():
            raise FileExistsError(f"--out {out}: already exists; give a new folder")
        shutil.copytree(folder, out)
        folder = out
    print(folder)
    return 0


def main(argv=None) -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="diffrlhf", description=__doc__, epilog=EXIT_CODES, formatter_class=fmt)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
    sub = parser.add_subparsers(dest="cmd")

    def command(name, what):
        return sub.add_parser(name, help=what, parents=[common], epilog=EXIT_CODES, formatter_class=fmt)

    p = command("train", "the distributed run on Ray (local or RAY_ADDRESS)")
    _config_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.set_defaults(fn=cmd_train)
    p = command("reference", "the single-process reference loop")
    _config_args(p)
    p.set_defaults(fn=cmd_reference, resume=None)
    p = command("sample", "images from a run's LoRA beside the base model's")
    p.add_argument("--run", required=True, help="run folder")
    p.add_argument("--prompts", default="tiny-world-eval", help="prompt list name or file (first 16 used)")
    p.add_argument("--lora", default="latest", help="epoch_XXXX folder name or latest")
    p.add_argument("--n", type=int, default=2, help="images per prompt")
    p.add_argument("--out", help="PNG path (default RUN_DIR/samples.png)")
    p.set_defaults(fn=cmd_sample)
    p = command("eval", "rewards (and CLIP score) of a run's LoRA on train and held-out prompts")
    p.add_argument("--run", required=True)
    p.add_argument("--lora", default="latest")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--clip", help="local CLIP model folder for the CLIP score (default: openai/clip-vit-large-patch14 from the HF cache)")
    p.add_argument("--out", help="JSON path (default RUN_DIR/eval.json)")
    p.set_defaults(fn=cmd_eval)
    p = command("fetch-weights", "download a reward model's weights into the cache (needs internet)")
    p.add_argument("name")
    p.add_argument("--dest", default=None)
    p.add_argument("--version", default="v2.1", help="hpsv2 only: v2.0 or v2.1")
    p.set_defaults(fn=cmd_fetch_weights)
    p = command("config", "`config keys`: every config key (type, default, range, meaning); "
                          "`config show`: the resolved config, each value with its source")
    p.add_argument("action", choices=["keys", "show"])
    p.add_argument("--preset", default="tiny", help="preset name (deploy/presets/*.yaml); default: tiny")
    p.add_argument("--config", help="a YAML file with config sections, applied over the preset")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=0.001")
    p.set_defaults(fn=cmd_config)
    p = command("reward-env", "build (or check) the own environment of a package reward: imagereward, hpsv2")
    p.add_argument("action", choices=["build", "check"])
    p.add_argument("name", choices=["imagereward", "hpsv2"])
    p.add_argument("--torch", help="torch release for the venv (default: this environment's, e.g. 2.13.0+cpu)")
    p.set_defaults(fn=cmd_reward_env)
    p = command("presets", "list config presets")
    p.set_defaults(fn=cmd_presets)
    p = command("base-model", "write the embedded model as a standard diffusers folder and print its path")
    p.add_argument("--out", help="copy it to this new folder (default: print the cached folder)")
    p.set_defaults(fn=cmd_base_model)
    args = parser.parse_args(argv)
    if args.cmd is None:  # `diffrlhf` alone: the main job on the embedded default
        args = parser.parse_args(["train"] + list(argv or sys.argv[1:]))
    try:
        return args.fn(args)
    except (Exception, KeyboardInterrupt) as e:
        code = _exit_code(e)
        if code is None or args.debug:
            raise
        print(f"error: {one_line(str(e))}" if str(e) else "error: interrupted", file=sys.stderr)
        return code


def one_line(message: str, width: int = 400) -> str:
    """An error as one line: a short message's lines joined ("no weights ...; fetch them with ...");
    a long one's first line and a pointer to --debug (Ray's advice, tracebacks of other processes)."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    joined = "; ".join(ln.rstrip(";") for ln in lines)
    if len(joined) <= width:
        return joined
    more = len(lines) - 1
    return lines[0] + (f" ({more} more line{'s' * (more > 1)} with --debug)" if more else "")


if __name__ == "__main__":
    sys.exit(main())
