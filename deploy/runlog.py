"""The run folder: config, metrics (JSON lines + TensorBoard), reward curve, image grids, checkpoints.

    runs/<name>/
      config.yaml            the config the run started with
      resumes.yaml           each resume's overrides, in order (applied over config.yaml)
      metrics.jsonl          one JSON object per epoch
      tb/                    TensorBoard scalars (same numbers)
      reward_curve.png       mean reward (+/- s.e.) against reward queries
      reward_terms.png       each reward's epoch mean against reward queries (a weighted_sum reward)
      recast.jsonl           ReCAST's probes: W, gains, discriminability, shifts (recast.mode != off)
      recast_weights.png     the last probe's W (rewards x steps) and each reward's gains
      grids/epoch_XXXX.png   sample images of chosen epochs
      lora/epoch_XXXX/       diffusers-format LoRA (pipe.load_lora_weights(folder))
      checkpoint/            the resumable state, checkpoint.prev/ the one before (see actors/checkpoint.py)
"""
from __future__ import annotations

import json
import math
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import yaml
from PIL import Image, ImageDraw

from diffrlhf.actors.observe import maybe_wandb
from diffrlhf.deploy.baseline import ddpo_band, gain_summary


def make_run_dir(cfg) -> Path:
    """A new run's folder. One that already holds a run is refused: a fresh run would append to
    its metrics and overwrite some of its LoRA epochs and checkpoint, mixing two runs."""
    name = cfg.run.name or f"{cfg.preset or 'run'}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    path = Path(cfg.run.out_dir) / name
    held = [f for f in ("metrics.jsonl", "checkpoint", "checkpoint.prev", "lora") if (path / f).exists()]
    if held:
        raise FileExistsError(
            f"run folder {path} already holds a run ({', '.join(held)}). Continue it with "
            f"`diffrlhf train --resume {path}`, or start a new one under another run.name (or delete the folder)."
        )
    path.mkdir(parents=True, exist_ok=True)
    return path


RESUMES = "resumes.yaml"  # beside config.yaml: each resume's overrides, in order (config.yaml stays as the run started)


def resume_overrides(run_dir: str | Path) -> list[list[str]]:
    """The overrides of each earlier resume of a run, oldest first."""
    path = Path(run_dir) / RESUMES
    return [entry["overrides"] for entry in (yaml.safe_load(path.read_text()) or [])] if path.exists() else []


class RunLogger:
    def __init__(self, run_dir: str | Path, cfg=None, tensorboard: bool = True, resume_overrides: list[str] | None = None):
        """cfg: written as config.yaml for a new run. resume_overrides (a resume): config.yaml is left
        as the run started, and these overrides are appended to resumes.yaml beside it."""
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if resume_overrides is not None and (self.dir / "config.yaml").exists():
            path = self.dir / RESUMES
            entries = (yaml.safe_load(path.read_text()) or []) if path.exists() else []
            entries.append({"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "overrides": list(resume_overrides)})
            path.write_text(yaml.safe_dump(entries, sort_keys=False))
        elif cfg is not None:
            (self.dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        self.records = self._read_existing()
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.dir / "tb"))
            except Exception as e:  # tensorboard missing: keep going with JSON lines, but say so
                print(f"[diffrlhf] TensorBoard logging off ({type(e).__name__}: {e})")

        self.wandb = maybe_wandb(cfg, self.dir) if cfg is not None else None
        self.t0 = time.time()

    def _read_existing(self) -> list[dict]:
        p = self.dir / "metrics.jsonl"
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []

    def truncate(self, epochs_done: int) -> None:
        """On resume: forget records of epochs that the checkpoint does not hold."""
        self.records = [r for r in self.records if r["epoch"] < epochs_done]
        with open(self.dir / "metrics.jsonl", "w") as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")

    def log(self, record: dict) -> None:
        record = {k: _plain(v) for k, v in record.items()}
        self.records.append(record)
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            step = int(record.get("reward_queries", record.get("epoch", 0)))
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))})

    def plot_reward_curve(self, title: str = "", band="auto") -> Path | None:
        """reward_curve.png: the run's epoch means (+- s.e.) against reward queries, over the committed
        DDPO baseline's band for the same settings (deploy/baseline.py). band: "auto" looks it up from
        the run's config.yaml (no band when no committed run matches), None draws none, or a ddpo_band()."""
        if not self.records:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        cfg_path = self.dir / "config.yaml"
        config = yaml.safe_load(cfg_path.read_text()) if cfg_path.exists() else {}
        if band == "auto":  # looked up once per logger: the driver redraws the curve every epoch
            if not hasattr(self, "_ddpo_band"):
                self._ddpo_band = ddpo_band(config) if config else None
            band = self._ddpo_band
        q = np.array([r["reward_queries"] for r in self.records])
        m = np.array([r["reward_mean"] for r in self.records])
        se = np.array([r.get("reward_se", 0.0) for r in self.records])
        fig, ax = plt.subplots(figsize=(7, 4.5))
        if band is not None:
            keep = band["queries"] <= q.max()  # the same budget as the run
            bq = band["queries"][keep]
            ax.fill_between(bq, band["min"][keep], band["max"][keep], color="0.6", alpha=0.35, lw=0, label=band["label"])
            ax.plot(bq, band["mean"][keep], color="0.35", ls="--", lw=1.2, label="DDPO baseline: mean of its seeds")
        scheme, mode = config.get("weighting", {}).get("scheme"), config.get("replay", {}).get("mode")
        who = f"this run: {scheme} weighting, replay {mode}" if scheme else "this run"
        ax.plot(q, m, marker="o", ms=3, color="C0", lw=1.8, label=who)
        ax.fill_between(q, m - se, m + se, color="C0", alpha=0.25, lw=0, label="this run: ± s.e. of the epoch mean")
        g = gain_summary(self.records)
        sub = f"\ngain (mean of last {g['epochs_averaged']} epochs - epoch 0): {g['gain']:+.3f} = {g['gain_in_se']:.1f} s.e." if g else ""
        ax.set_title((title or self.dir.name) + sub, fontsize=10)
        last = self.records[-1]
        redone = last.get("reward_queries_lost", 0)
        ax.set_xlabel("reward queries of the trained epochs" + (f" ({last.get('reward_queries_total')} answered in all, "
                                                                f"{redone} re-done after a stop)" if redone else ""))
        ax.set_ylabel("mean reward of the epoch's samples")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1)  # below: never over a curve
        fig.tight_layout()
        out = self.dir / "reward_curve.png"
        fig.savefig(out, dpi=110, bbox_inches="tight")
        plt.close(fig)
        return out

    def plot_reward_terms(self) -> Path | None:
        """reward_terms.png: each term of a weighted_sum reward, its epoch mean against reward queries."""
        names = [k.split("/", 1)[1] for k in (self.records[-1] if self.records else {}) if k.startswith("reward_mean/")]
        if not names:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        q = [r["reward_queries"] for r in self.records]
        fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4), squeeze=False)
        for ax, name in zip(axes[0], names):
            ax.plot(q, [r.get(f"reward_mean/{name}", float("nan")) for r in self.records], marker="o", ms=3)
            ax.set_title(name, fontsize=10)
            ax.set_xlabel("reward queries")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("epoch mean (unweighted)")
        fig.tight_layout()
        out = self.dir / "reward_terms.png"
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out

    def log_recast(self, result: dict) -> Path:
        """One ReCAST probe: a line of recast.jsonl and recast_weights.png (its W and gains)."""
        with open(self.dir / "recast.jsonl", "a") as f:
            f.write(json.dumps(recast_record(result)) + "\n")
        return save_recast_picture(result, self.dir / "recast_weights.png")

    def save_grid(self, images, captions: list[str], name: str, cols: int = 8) -> Path:
        out = self.dir / "grids" / f"{name}.png"
        save_image_grid(images, captions, out, cols)
        return out

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def save_image_grid(images, captions: list[str] | None, path: str | Path, cols: int = 8, scale: int = 0) -> Path:
    """uint8 [N, H, W, 3] -> one PNG grid, with small captions when the images are large enough."""

    images = np.asarray(images)
    n, h, w, _ = images.shape
    if not scale:
        scale = max(1, 128 // w)  # tiny 64 px images are upscaled to be visible
    cols = min(cols, n)
    rows = math.ceil(n / cols)
    cap_h = 12 if captions else 0
    hw, ww = h * scale, w * scale
    grid = Image.new("RGB", (cols * ww, rows * (hw + cap_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i in range(n):
        r, c = divmod(i, cols)
        img = Image.fromarray(images[i]).resize((ww, hw), Image.NEAREST)
        grid.paste(img, (c * ww, r * (hw + cap_h)))
        if captions:
            draw.text((c * ww + 2, r * (hw + cap_h) + hw), captions[i][: ww // 6], fill="black")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


def recast_record(result: dict) -> dict:
    """What a ReCAST probe's result keeps (a line of recast.jsonl): plain lists, JSON-ready."""
    keys = ("round", "term_names", "budgets", "shifts", "queries", "weights", "gains", "discriminability")
    return {k: np.asarray(result[k]).tolist() if k in ("weights", "gains", "discriminability") else result[k] for k in keys}


def save_recast_picture(result: dict, path: str | Path) -> Path:
    """W as a heatmap (rewards x denoising steps, the first step left) beside each reward's gains."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w, g, names = np.asarray(result["weights"]), np.asarray(result["gains"]), result["term_names"]
    t = w.shape[1]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 1.2 + 0.6 * len(names) + 2), gridspec_kw={"width_ratios": [3, 2]})
    im = a.imshow(t * w, aspect="auto", cmap="viridis", vmin=0)
    a.set_yticks(range(len(names)), names)
    a.set_xlabel("denoising step (1 = from pure noise)")
    a.set_xticks(range(0, t, max(1, t // 10)), [str(i + 1) for i in range(0, t, max(1, t // 10))])
    a.set_title(f"ReCAST T*W after {result['round']} updates (each column sums to 1)", fontsize=10)
    fig.colorbar(im, ax=a, fraction=0.04)
    for i, name in enumerate(names):
        b.plot(range(1, t + 1), g[i], marker="o", ms=3, label=name)
    b.set_xlabel("denoising step")
    b.set_ylabel("discriminability gain")
    b.grid(alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plain(v):
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        return v.item()
    return v
