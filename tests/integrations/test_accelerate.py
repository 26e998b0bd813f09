"""accelerate with ruda_torch.AdamW(fused_step=True) beside torch.optim.AdamW: `prepare`,
`clip_grad_norm_`, and `save_state` / `load_state` that continue bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from training import TRAINING_ATOL, assert_trained_alike

import ruda_torch

accelerate = pytest.importorskip("accelerate")

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
STEPS = 10


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen))
            for _ in range(STEPS)]  # fmt: skip


def _run(make_opt, steps=range(STEPS), state=None, save_at=None, tmp_path=None):
    acc = accelerate.Accelerator(cpu=True)
    model = _model()
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, sched = acc.prepare(model, opt, sched)
    if state is not None:
        acc.load_state(state)
    data = _batches()
    for step in steps:
        x, y = data[step]
        opt.zero_grad()
        acc.backward(nn.functional.mse_loss(model(x), y))
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if save_at is not None and step + 1 == save_at:
            acc.save_state(str(tmp_path))
    return acc.unwrap_model(model), opt


def _ours(params):
    return ruda_torch.AdamW(params, **HYPER, fused_step=True)


def test_accelerate_trains_like_torch():
    ours, opt = _run(_ours)
    theirs, _ = _run(lambda p: torch.optim.AdamW(p, **HYPER))
    assert isinstance(opt.optimizer, ruda_torch.AdamW)
    assert_trained_alike(ours, theirs, "accelerate")
    moved = max((p.detach() - q.detach()).abs().max().item()
                for p, q in zip(ours.parameters(), _model().parameters(), strict=True))  # fmt: skip
    assert moved > 100 * TRAINING_ATOL


def test_accelerate_save_and_load_state_is_bit_identical(tmp_path):
    straight, _ = _run(_ours, save_at=5, tmp_path=tmp_path)
    resumed, opt = _run(_ours, steps=range(5, STEPS), state=str(tmp_path))
    assert float(next(iter(opt.optimizer.state.values()))["step"]) == STEPS
    for (name, p), q in zip(resumed.named_parameters(), straight.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: the resumed run differs from the straight one"
