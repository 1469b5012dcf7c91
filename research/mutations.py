"""Break each pinned definition once, run the tests that should catch it, restore (issue 56).

    python -m research.mutations                       # every mutation against tests/test_definitions.py
    ONLY=window TESTS="tests/test_definitions.py tests/test_timesteps.py" python -m research.mutations

One line per mutation: CAUGHT (a test failed) or MISSED. The source file is restored after each,
whatever happens. A lab tool: nothing imports it."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MUTATIONS = [
    ("ddim_std weights sigma_t -> sigma_t^2", "learner/weighting.py", "w = ddim_std(scheduler, t.long(), eta)", "w = ddim_std(scheduler, t.long(), eta) ** 2"),
    ("latent_sq power 2 -> 3", "learner/weighting.py", "w = latent_change(latents, 2, reduce)", "w = latent_change(latents, 3, reduce)"),
    ("latent_abs power 1 -> 2", "learner/weighting.py", "w = latent_change(latents, 1, reduce)", "w = latent_change(latents, 2, reduce)"),
    ("gaussian 2 width^2 -> width^2", "learner/weighting.py", "(2 * gaussian_width**2)", "(gaussian_width**2)"),
    ("gaussian_late centre 1.0 -> 0.9", "learner/weighting.py", '"gaussian_late": 1.0', '"gaussian_late": 0.9'),
    ("oracle negative shares kept", "learner/weighting.py", "w = shares.clamp(min=0)", "w = shares.abs()"),
    ("advantage lower clip dropped", "buffer/advantages.py", "np.clip(adv, -self.clip_max, self.clip_max)", "np.minimum(adv, self.clip_max)"),
    ("advantage upper clip dropped", "buffer/advantages.py", "np.clip(adv, -self.clip_max, self.clip_max)", "np.maximum(adv, -self.clip_max)"),
    ("batch advantage std ddof 0 -> 1", "buffer/advantages.py", "return (r - r.mean()) / (r.std() + 1e-6)", "return (r - r.mean()) / (r.std(ddof=1) + 1e-6)"),
    ("replay ties oldest epoch first", "buffer/replay.py", "current_epoch - self.max_epochs <= e < current_epoch), reverse=True)", "current_epoch - self.max_epochs <= e < current_epoch), reverse=False)"),
    ("replay unstable sort", "buffer/replay.py", "descending=True, stable=True)", "descending=True, stable=False)"),
    ("replay priority A instead of |A|", "buffer/replay.py", "torch.argsort(past.advantages.abs(), descending=True", "torch.argsort(past.advantages, descending=True"),
    ("replay window one epoch wider", "buffer/replay.py", "if current_epoch - self.max_epochs <= e < current_epoch", "if current_epoch - self.max_epochs - 1 <= e < current_epoch"),
    ("weighted selection coefficient 1/pi", "learner/timesteps.py", "(k_eff / (t * pi[steps])).float()", "(1 / pi[steps]).float()"),
    ("num_trained_steps truncates", "learner/timesteps.py", "max(1, int(round(num_steps * fraction)))", "max(1, int(num_steps * fraction))"),
    ("top takes the smallest weights", "learner/timesteps.py", "torch.topk(w.double(), k).indices", "torch.topk(w.double(), k, largest=False).indices"),
    ("window start p*(T-k) instead of p*(T-k+1)", "learner/timesteps.py", "start = min(t - k, int(progress * (t - k + 1)))", "start = min(t - k, int(progress * (t - k)))"),
    ("inclusion probabilities uncapped (no redistribution)", "learner/timesteps.py", "        capped |= over\n", "        return pi.clamp(max=1.0)\n"),
    ("backward schedule without the +1", "learner/timesteps.py", "first + int(progress * (num_steps - first + 1) + 1e-9)", "first + int(progress * (num_steps - first) + 1e-9)"),
]
ONLY = os.environ.get("ONLY")
for name, rel, old, new in [m for m in MUTATIONS if not ONLY or ONLY in m[0]]:
    path = ROOT / rel
    src = path.read_text()
    if src.count(old) != 1:
        print(f"SKIP {name}: pattern found {src.count(old)} times"); continue
    path.write_text(src.replace(old, new))
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *os.environ.get("TESTS", "tests/test_definitions.py").split()],
                           cwd=ROOT, capture_output=True, text=True)
        failed = [l for l in r.stdout.splitlines() if l.startswith("FAILED")]
        print(f"{'CAUGHT' if r.returncode else 'MISSED'} {name}: {failed[0].split(' - ')[0] if failed else r.stdout.strip().splitlines()[-1]}", flush=True)
    finally:
        path.write_text(src)
