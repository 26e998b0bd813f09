"""What the integration tests compare a trained model with."""

from __future__ import annotations

import torch

# Note [Training-level tolerance]: in a training loop the gradients depend on the
# parameters, so the few-ulp differences between ruda_torch's and torch's FP32 update
# (Note [Optimizer-level tolerance]) feed back through the model at every step instead of
# staying a few ulps. Measured over these tests' 10 steps at lr 1e-3: at most 7e-7 on any
# parameter (parameters move by about 1e-2). 2e-5 absolute is 30 times that and still
# 500 times below one step's movement, so a wrong update (a missed step, lr or decay off
# by 1%) fails.
TRAINING_ATOL = 2e-5


def assert_trained_alike(a, b, what: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(
            p.detach().float(),
            q.detach().float(),
            rtol=0,
            atol=TRAINING_ATOL,
            msg=lambda m, n=name: f"{what}: {n}: {m}",
        )
