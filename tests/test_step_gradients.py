"""Issue 56's account of why `ddim_std` wins (research/bench/step_gradients.py): the DDIM mean's
coefficient on the noise prediction, and the evenness measures."""
import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler

from diffrlhf.policy.ddim import ddim_std, ddim_step_mean_std
from research.bench import step_gradients as sg


@pytest.mark.parametrize("eta", [1.0, 0.5])
def test_the_mean_coefficient_is_the_derivative_of_the_step_mean_in_the_noise_prediction(eta):
    sched = DDIMScheduler(**sg.SD15_SCHEDULER)
    sched.set_timesteps(20)
    c = sg.mean_coefficient(sched, sched.timesteps, eta)
    x = torch.randn(1, 4, 2, 2, dtype=torch.float64)
    eps = torch.randn_like(x)
    for i, t in enumerate(sched.timesteps):
        m0, _ = ddim_step_mean_std(sched, eps, t, x, eta)
        m1, _ = ddim_step_mean_std(sched, eps + 1e-3, t, x, eta)
        assert float((m1 - m0).mean() / 1e-3) == pytest.approx(c[i], rel=1e-6, abs=1e-9)
    pred = sg.predicted_norm(sched, sched.timesteps, eta)
    np.testing.assert_allclose(pred, np.abs(c) / ddim_std(sched, sched.timesteps.long(), eta).numpy())


def test_evenness_of_flat_and_skewed_profiles():
    flat = sg.evenness(np.ones(8))
    assert flat == {"cv": 0.0, "max_over_min": 1.0, "last_quarter_share": 0.25}
    skew = sg.evenness([1, 1, 1, 1, 1, 1, 2, 8])
    assert skew["max_over_min"] == 8.0 and skew["last_quarter_share"] == pytest.approx(10 / 16)
