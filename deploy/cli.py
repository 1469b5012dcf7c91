"""The `diffrlhf` command.

    diffrlhf train [--preset tiny] [--config FILE] [--resume RUN_DIR] [key.sub=value ...]
    diffrlhf reference [...]            the single-process reference loop (same options)
    diffrlhf sample --run RUN_DIR --prompts FILE   images of the trained LoRA beside the base model's (a grid)
    diffrlhf eval --run RUN_DIR         reward on train and held-out prompts (+ CLIP score if CLIP weights exist)
    diffrlhf fetch-weights NAME         download a reward model's weights (needs internet)
    diffrlhf presets                    list presets

Under `ray job submit` (RAY_ADDRESS set) `train` joins the cluster; otherwise it starts a local Ray.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help="preset name (deploy/presets/*.yaml); default: tiny, the embedded default")
    p.add_argument("--config", help="a YAML file with config sections, applied over the preset")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=0.001 replay.mode=hardmine")


def load_cfg(args):
    from diffrlhf.deploy.config import config_from_dict, load_config, parse_override, _apply, validate

    if getattr(args, "resume", None):
        import yaml

        path = Path(args.resume) / "config.yaml"
        if not path.exists():
            raise SystemExit(f"error: --resume {args.resume}: no config.yaml there; is it a run folder?")
        cfg = config_from_dict(yaml.safe_load(path.read_text()))
        for o in args.overrides:
            _apply(cfg, parse_override(o))
        cfg = validate(cfg)
        cfg.run.out_dir, cfg.run.name = str(Path(args.resume).parent), Path(args.resume).name
        return cfg
    return load_config(args.preset, args.config, args.overrides)


def check_model(cfg) -> None:
    """Resolve the model before any actor starts: a missing model is a clear error, not a dead actor."""
    from diffrlhf.policy.models import resolve_model

    resolve_model(cfg.model.name)


def cmd_train(args) -> int:
    from diffrlhf.actors.driver import Driver, init_ray
    from diffrlhf.deploy.runlog import RunLogger, make_run_dir

    cfg = load_cfg(args)
    check_model(cfg)
    run_dir = Path(args.resume) if args.resume else make_run_dir(cfg)
    logger = RunLogger(run_dir, cfg, tensorboard=cfg.run.tensorboard)
    print(f"[diffrlhf] run folder: {run_dir}")
    init_ray(cfg)
    driver = Driver(cfg, run_dir, logger=logger, progress=not args.no_progress, resume=bool(args.resume))
    t0 = time.time()
    try:
        records = driver.run()
    finally:
        logger.close()
    wall = time.time() - t0
    (run_dir / "roles.json").write_text(json.dumps(driver.role_stats, indent=1))
    driver.metrics.roles(driver.role_stats)
    logger.plot_reward_curve()
    _summary(records, wall, run_dir, driver.role_stats)
    return 0


def cmd_reference(args) -> int:
    from diffrlhf.deploy.runlog import RunLogger, make_run_dir
    from diffrlhf.actors.reference_loop import run_reference

    cfg = load_cfg(args)
    check_model(cfg)
    run_dir = make_run_dir(cfg)
    logger = RunLogger(run_dir, cfg, tensorboard=cfg.run.tensorboard)
    t0 = time.time()
    records = run_reference(cfg, logger=logger, progress=not args.no_progress)
    logger.plot_reward_curve()
    logger.close()
    _summary(records, time.time() - t0, run_dir, [])
    return 0


def _summary(records, wall, run_dir, roles) -> None:
    if records:
        a, b = records[0], records[-1]
        print(f"[diffrlhf] {len(records)} epochs in {wall:.1f}s; reward {a['reward_mean']:.4f} -> {b['reward_mean']:.4f} "
              f"over {b['reward_queries']} reward queries")
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
    from diffrlhf.deploy.evaluate import cmd_eval as evaluate, format_table

    result = evaluate(args.run, args.lora, args.n, args.clip, args.out)
    print(format_table(result))
    print(f"[diffrlhf] results: {result['path']}")
    return 0


def cmd_fetch_weights(args) -> int:
    from diffrlhf.rewards.fetch import main as fetch_main

    return fetch_main([args.name] + (["--dest", args.dest] if args.dest else []) + ["--version", args.version])


def cmd_presets(args) -> int:
    from diffrlhf.deploy.config import presets

    print("\n".join(presets()))
    return 0


def main(argv=None) -> int:
    from diffrlhf.policy.models import ModelNotFoundError
    from diffrlhf.deploy.config import ConfigError

    parser = argparse.ArgumentParser(prog="diffrlhf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd")
    p = sub.add_parser("train", help="the distributed run on Ray (local or RAY_ADDRESS)")
    _config_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("reference", help="the single-process reference loop")
    _config_args(p)
    p.set_defaults(fn=cmd_reference, resume=None)
    p = sub.add_parser("sample", help="images from a run's LoRA beside the base model's")
    p.add_argument("--run", required=True, help="run folder")
    p.add_argument("--prompts", default="tiny-world-eval", help="prompt list name or file (first 16 used)")
    p.add_argument("--lora", default="latest", help="epoch_XXXX folder name or latest")
    p.add_argument("--n", type=int, default=2, help="images per prompt")
    p.add_argument("--out", help="PNG path (default RUN_DIR/samples.png)")
    p.set_defaults(fn=cmd_sample)
    p = sub.add_parser("eval", help="rewards (and CLIP score) of a run's LoRA on train and held-out prompts")
    p.add_argument("--run", required=True)
    p.add_argument("--lora", default="latest")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--clip", help="local CLIP model folder for the CLIP score (default: openai/clip-vit-large-patch14 from the HF cache)")
    p.add_argument("--out", help="JSON path (default RUN_DIR/eval.json)")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("fetch-weights", help="download a reward model's weights into the cache (needs internet)")
    p.add_argument("name")
    p.add_argument("--dest", default=None)
    p.add_argument("--version", default="v2.1", help="hpsv2 only: v2.0 or v2.1")
    p.set_defaults(fn=cmd_fetch_weights)
    p = sub.add_parser("presets", help="list config presets")
    p.set_defaults(fn=cmd_presets)
    args = parser.parse_args(argv)
    if args.cmd is None:  # `diffrlhf` alone: the main job on the embedded default
        args = parser.parse_args(["train"] + list(argv or sys.argv[1:]))
    try:
        return args.fn(args)
    except (ConfigError, ModelNotFoundError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
