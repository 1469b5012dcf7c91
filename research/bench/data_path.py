"""Bytes per epoch per hop of the data path (issue 51, step 2: the "before" table).

    python -m research.bench.data_path --tag after [--epochs 5] [--out DIR]

Measured on the tiny world: the four roles' classes run in this process (the same methods the Ray
actors run, actors/workers.py), and each payload that crosses a process boundary in the Ray system
is serialised as Ray serialises it (pickle protocol 5, numpy buffers out of band; a
TrajectoryBatch pickles as its Arrow IPC bytes) and counted:

    broadcast         the learner's new LoRA (version, FlatLoRA), once per sampler
    sampler->reward   the reward input (ids, images, prompts), per batch
    reward->buffer    the scores, per batch
    sampler->buffer   the whole trajectory batch, per batch
    buffer->learner   the epoch's training batch (this epoch's rows plus replay)
    checkpoint        torch.save of the driver's state (learner, buffer, counters, LoRA versions)

Each payload is also split by field, so the table shows which fields a hop carries but its reader
never reads (the learner does not read `images`). For SD1.5 at 512 px and 50 steps the same
payloads are computed from the fields' shapes and dtypes (`row_bytes`); the model is checked against
the tiny world's measured batch (the Arrow framing is the only difference).
Writes data_path_<tag>.json and .md into research/results/data_path/ or --out (committed: "before",
at d97af19, and "after" the data-path change of issue 51 step 3).
"""
from __future__ import annotations

import argparse
import io
import pickle
from pathlib import Path

import torch

from research.bench.common import log, machine, out_dir, write_json

HOPS = ("broadcast", "sampler->reward", "reward->buffer", "sampler->buffer", "buffer->learner", "checkpoint")
# What each hop's reader reads of a trajectory batch (actors/workers.py, learner/update.py): the
# bytes in a hop beyond these are carried for nothing.
READ_BY_LEARNER = ("latents", "timesteps", "log_probs", "prompt_embeds", "advantages", "term_advantages", "policy_version",
                   "sample_ids", "replayed")


SD15_LORA_PARAMS = 797_184  # a rank-4 attention LoRA on SD1.5's UNet (RESULTS, "What is known at SD1.5's size?")


def wire_bytes(obj) -> int:
    """The bytes Ray's object store holds for obj: the pickle-5 stream plus its out-of-band buffers."""
    buffers: list = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return len(data) + sum(memoryview(b).nbytes for b in buffers)


def saved_bytes(obj) -> int:
    """The bytes of obj as actors/checkpoint.py writes it (its pickle protocol)."""
    from diffrlhf.actors.checkpoint import PICKLE_PROTOCOL

    f = io.BytesIO()
    torch.save(obj, f, pickle_protocol=PICKLE_PROTOCOL)
    return f.tell()


def field_bytes(batch) -> dict[str, int]:
    from diffrlhf.buffer.trajectory import TENSOR_FIELDS

    return {name: getattr(batch, name).numel() * getattr(batch, name).element_size() for name in TENSOR_FIELDS}


def row_bytes(steps: int, latent_shape: tuple[int, int, int], text_tokens: int, text_dim: int, image_px: int,
              rewards: int = 0) -> dict[str, int]:
    """One trajectory's bytes per field, from the shapes and dtypes of buffer/trajectory.py's fields."""
    c, h, w = latent_shape
    return {"latents": (steps + 1) * c * h * w * 4, "timesteps": steps * 8, "log_probs": steps * 4,
            "prompt_embeds": text_tokens * text_dim * 4, "images": image_px * image_px * 3, "seeds": 8, "policy_version": 8,
            "sample_ids": 8, "rewards": 4, "advantages": 4, "replayed": 1, "reward_terms": rewards * 4, "term_advantages": 0}


def measure(epochs: int) -> dict:
    """The tiny preset's epochs through the roles' classes in this process, each hop's payload counted."""
    from diffrlhf.actors.settings import plan_for
    from diffrlhf.actors.workers import BufferWorker, LearnerWorker, RewardRoleConfig, RewardWorker, SamplerWorker
    from diffrlhf.deploy.config import load_config
    from diffrlhf.policy.prompts import load_prompts

    cfg = load_config("tiny", overrides=["system.torch_threads=1"])
    prompts = load_prompts(cfg.prompts.train)
    sampler, reward, buffer, learner = SamplerWorker(cfg), RewardWorker(RewardRoleConfig.of(cfg)), BufferWorker(cfg), LearnerWorker(cfg)
    weights = learner.weights()
    per_epoch, fields = [], {}
    for epoch in range(epochs):
        hop = dict.fromkeys(HOPS, 0)
        hop["broadcast"] = wire_bytes(weights) * cfg.system.num_samplers
        for bi in range(cfg.sample.batches_per_epoch):
            _, reward_input, batch = sampler.sample(plan_for(cfg, prompts, epoch, bi), weights)
            score = reward.score(reward_input)
            hop["sampler->reward"] += wire_bytes(reward_input)
            hop["reward->buffer"] += wire_bytes(score)
            hop["sampler->buffer"] += wire_bytes(batch)
            buffer.add_scored(epoch, bi, batch, score)
            fields = field_bytes(batch)
        buffer.finalize_epoch(epoch)
        training = buffer.training_batch(epoch)
        hop["buffer->learner"] = wire_bytes(training)
        learner_fields = field_bytes(training)
        _, weights = learner.update(training)
        versions = {weights[0]: weights[1].to_state_dict()}
        learner_state, buffer_state = learner.state_dict(), buffer.state_dict()
        hop["checkpoint"] = saved_bytes({"learner": learner_state, "buffer": buffer_state, "versions": versions})
        per_epoch.append({"epoch": epoch, "bytes": hop, "training_rows": len(training), "checkpoint_learner": saved_bytes(learner_state),
                          "checkpoint_buffer": saved_bytes(buffer_state), "buffer_epochs_held": len(buffer.replay.epochs),
                          "learner_unread_bytes": sum(v for k, v in learner_fields.items() if k not in READ_BY_LEARNER)})
        log("data_path", f"epoch {epoch}: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in hop.items()))
    b, t = batch.latents.shape[0], batch.num_steps
    shape = tuple(batch.latents.shape[2:])
    model = row_bytes(t, shape, batch.prompt_embeds.shape[1], batch.prompt_embeds.shape[2], batch.images.shape[1])
    return {"config": {"preset": "tiny", "batch_size": cfg.sample.batch_size, "batches_per_epoch": cfg.sample.batches_per_epoch,
                       "num_samplers": cfg.system.num_samplers, "steps": t, "latent_shape": shape, "image_px": batch.images.shape[1],
                       "replay": {k: getattr(cfg.replay, k) for k in ("mode", "k", "max_epochs")}},
            "epochs": per_epoch, "batch_fields": {k: v // b for k, v in fields.items()}, "row_model": model,
            "lora_params": int(weights[1].numel)}


def checkpoint_inflation(result: dict) -> float:
    """The buffer's bytes in the checkpoint over the Arrow bytes of the epochs it holds (last epoch):
    1.53x with checkpoint format 1 (pickle protocol 2 writes a bytes object as latin-1 text, every
    byte >= 0x80 taking two), about 1 with format 2."""
    last = result["epochs"][-1]
    return last["checkpoint_buffer"] / (last["buffer_epochs_held"] * last["bytes"]["sampler->buffer"])


def sd15(lora_params: int, result: dict) -> dict:
    """The same hops for the sd15-ddpo preset's shapes (512 px, 50 steps, 256 samples an epoch), with
    what the code does as measured on the tiny world: the fields each hop carries (those with bytes
    there), the epochs the buffer holds at its steady state (the same replay settings: checked) and
    the checkpoint's bytes per Arrow byte."""
    from diffrlhf.deploy.config import load_config

    cfg = load_config("sd15-ddpo")
    replay = {k: getattr(cfg.replay, k) for k in ("mode", "k", "max_epochs")}
    if replay != result["config"]["replay"]:
        raise SystemExit(f"sd15-ddpo's replay settings {replay} differ from the measured tiny run's {result['config']['replay']}")
    s, last = cfg.sample, result["epochs"][-1]
    row = row_bytes(s.num_steps, (4, s.resolution // 8, s.resolution // 8), 77, 768, s.resolution)
    n = s.batch_size * s.batches_per_epoch
    carried = sum(v for k, v in row.items() if result["batch_fields"].get(k, 0) > 0)  # the buffer's and learner's row
    reward_row = row["images"] + row["sample_ids"] + 40  # the prompt text: a few tens of bytes
    return {"config": {"preset": "sd15-ddpo", "samples_per_epoch": n, "steps": s.num_steps, "resolution": s.resolution,
                       "num_samplers": cfg.system.num_samplers, "lora_rank": cfg.model.lora_rank},
            "row": row,
            "bytes": {"broadcast": lora_params * 4 * cfg.system.num_samplers, "sampler->reward": reward_row * n,
                      "reward->buffer": 16 * n, "sampler->buffer": carried * n, "buffer->learner": carried * n,
                      # the epochs of rows the buffer holds, at the measured bytes per Arrow byte; the learner's
                      # LoRA plus Adam's two moments, fp32
                      "checkpoint": round(last["buffer_epochs_held"] * carried * n * checkpoint_inflation(result)) + 3 * 4 * lora_params},
            "checkpoint_inflation": checkpoint_inflation(result),
            "learner_unread_bytes": sum(row[k] for k in ("images", "seeds", "rewards", "reward_terms")
                                        if result["batch_fields"].get(k, 0) > 0) * n}


def table(result: dict, sd: dict) -> str:
    tiny = result["epochs"][-1]["bytes"]
    lines = ["| hop | tiny world, measured (MB per epoch) | SD1.5 512 px, 50 steps, 256 samples (GB per epoch, computed) |",
             "| --- | --- | --- |"]
    for hop in HOPS:
        lines.append(f"| {hop} | {tiny[hop] / 1e6:.3f} | {sd['bytes'][hop] / 1e9:.3f} |")
    f = result["batch_fields"]
    total = sum(f.values())
    lines += ["", "Per trajectory, by field (tiny world measured / SD1.5 computed, bytes):", "",
              "| field | tiny | SD1.5 | share of SD1.5's row |", "| --- | --- | --- | --- |"]
    for k, v in sd["row"].items():
        lines.append(f"| {k} | {f.get(k, 0)} | {v} | {v / sum(sd['row'].values()):.1%} |")
    last = result["epochs"][-1]
    rows = result["config"]["batch_size"] * result["config"]["batches_per_epoch"]
    lines += ["", f"Checkpoint by epoch (tiny, MB: learner / buffer, epochs of trajectories the buffer holds): " + "; ".join(
        f"epoch {e['epoch']}: {e['checkpoint_learner'] / 1e6:.2f} / {e['checkpoint_buffer'] / 1e6:.2f} ({e['buffer_epochs_held']})"
        for e in result["epochs"]) + ".",
              "", f"The buffer's bytes in the checkpoint are {sd['checkpoint_inflation']:.2f}x the Arrow bytes of the epochs it "
              f"holds (checkpoint format 1, torch.save's pickle protocol 2, wrote bytes as latin-1 text: 1.53x); the SD1.5 "
              f"checkpoint column applies that factor to the {last['buffer_epochs_held']} epoch(s) of rows the buffer holds at "
              "its steady state here (the same replay settings), plus the LoRA and Adam's moments.",
              "", f"Row model against the tiny world's measurement: {rows} rows x {total} B = {rows * total / 1e6:.3f} MB; "
              f"sampler->buffer measured {last['bytes']['sampler->buffer'] / 1e6:.3f} MB (Arrow framing, prompts, metadata: "
              f"{last['bytes']['sampler->buffer'] / (rows * total) - 1:+.1%})."]
    lines += ["", f"Tiny row total {total} B; the Arrow IPC form adds framing. Bytes the learner receives but never reads "
              f"(images if carried, seeds, rewards): tiny {result['epochs'][-1]['learner_unread_bytes'] / 1e6:.3f} MB an epoch, SD1.5 "
              f"{sd['learner_unread_bytes'] / 1e9:.3f} GB an epoch."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", required=True, help="names the files: data_path_<tag>.json / .md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.epochs)
    sd = sd15(SD15_LORA_PARAMS, result)
    folder = out_dir("data_path", args.out)
    write_json(folder / f"data_path_{args.tag}.json", {"machine": machine(), "command": f"python -m research.bench.data_path --tag {args.tag}",
                                                      "tiny": result, "sd15": sd})
    (folder / f"data_path_{args.tag}.md").write_text(table(result, sd))
    print(table(result, sd))


if __name__ == "__main__":
    main()
