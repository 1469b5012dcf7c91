"""Peak memory per role at SD1.5's size on CPU, beside the parameter count's prediction (issue 55 item 4).

    python -m research.bench.role_memory --run DIR [--run DIR ...] [--out DIR]

Each DIR: a finished `diffrlhf train` run folder of `model.name=sd15-random` (its roles.json holds each
role's peak RSS, read by the role itself). The prediction for a role that holds the model (samplers,
learner ranks): the fp32 bytes of SD1.5's UNet (with the run's LoRA), text encoder and VAE, counted
from their parameters on the meta device, plus the process without a model (the buffer's measured
peak in the same run: Python, torch, Ray). For the other roles: that process alone. Activations at
the runs' 64 px and the learner's Adam state (16 bytes per LoRA parameter, 12.8 MB) are left out:
small here. The weight files are memory-mapped, so the roles' sum can exceed the machine's use.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from research.bench.common import out_dir, write_report

THRESHOLD = 0.25


def model_bytes(lora_rank: int) -> dict:
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffrlhf.tinyworld.architecture import SD15_TEXT, SD15_VAE
    from research.bench.stage_time import unet_on_meta

    with torch.device("meta"):
        vae = AutoencoderKL(**SD15_VAE)
        text = CLIPTextModel(CLIPTextConfig(**SD15_TEXT))
    unet = unet_on_meta(lora_rank)
    count = {name: sum(p.numel() for p in m.parameters()) for name, m in (("unet", unet), ("text_encoder", text), ("vae", vae))}
    return {"parameters": count, "fp32_bytes": 4 * sum(count.values())}


def rows_for(run: Path, weights_bytes: int) -> list[dict]:
    roles = json.loads((run / "roles.json").read_text())
    baseline = next(r["peak_rss_gb"] for r in roles if r["role"] == "buffer")
    out = []
    for r in roles:
        holds_model = r["role"].startswith(("sampler", "learner"))
        predicted = baseline + (weights_bytes / 2**30 if holds_model else 0.0)
        out.append({"run": run.name, "role": r["role"], "peak_rss_gb": r["peak_rss_gb"], "predicted_gb": predicted,
                    "measured_over_predicted": r["peak_rss_gb"] / predicted, "holds_model": holds_model})
    return out


def markdown(res: dict) -> str:
    lines = [f"Peak RSS per role (GiB, read by each role) beside the prediction: the fp32 weights of SD1.5's UNet + LoRA, "
             f"text encoder and VAE ({res['weights_gb']:.2f} GiB, {sum(res['parameters'].values()):,} parameters) for a "
             f"role that holds the model, plus the process without a model (the buffer's peak in the same run).", "",
             "| run | role | peak RSS | predicted | measured / predicted |", "| --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        lines.append(f"| {r['run']} | {r['role']} | {r['peak_rss_gb']:.2f} | {r['predicted_gb']:.2f} | {r['measured_over_predicted']:.2f} |")
    model = [r["measured_over_predicted"] for r in res["rows"] if r["holds_model"]]
    lines += ["", f"Roles that hold the model: measured / predicted {min(model):.2f} to {max(model):.2f} "
                  f"(median {statistics.median(model):.2f}); beyond {THRESHOLD:.0%}: "
                  f"{sum(abs(x - 1) > THRESHOLD for x in model)} of {len(model)}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", action="append", required=True, help="a finished sd15-random run folder (repeatable)")
    p.add_argument("--lora-rank", type=int, default=4)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    counted = model_bytes(a.lora_rank)
    weights = counted["fp32_bytes"]
    res = {"runs": a.run, "parameters": counted["parameters"], "weights_gb": weights / 2**30,
           "rows": [row for run in a.run for row in rows_for(Path(run), weights)], "threshold": THRESHOLD}
    return write_report(out_dir("role_memory", a.out), "role_memory", res, markdown(res))


if __name__ == "__main__":
    main()
