"""Policy-gradient algorithms as parts behind one small interface (veRL-style registry).

An algorithm says, for the roles that call it:
- `defaults`: its own layer of config values (key table < algorithm < preset < file < override);
- `check(cfg)`: what it needs of the other keys (one message, or None);
- `branch_step(cfg, epoch)`: where the samplers branch each prompt's samples (None: plain trajectories);
- `train_rows(cfg)`: which of an epoch's scored rows train (None: all), for the buffer;
- `uses_pretrained`: the update also computes the pretrained model's step mean (for a KL);
- `step_loss(...)`: its loss at one trained step of a mini-batch, and the stats it records.
The samplers, the buffer, the learner and the driver call these and name no algorithm.

Adding one: a new module here with a subclass of `Algorithm`, decorated with `@register`
(docs/algorithms.md).
"""
from __future__ import annotations

from .base import Algorithm, StepContext, get, names, register
from . import ddpo, dpok, b2diffurl  # noqa: F401, I001  (registers them, in this order)

__all__ = ["Algorithm", "StepContext", "get", "names", "register"]
