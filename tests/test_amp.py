"""ruda_torch.amp.GradScaler (Note [One gradient pass under GradScaler] in
ruda_torch/amp.py): the same skipped steps and the same scale schedule as torch's
GradScaler with ruda_torch.AdamW, without torch's gradient pass; torch's behaviour for
every other case."""

from __future__ import annotations

import pytest
import torch
from optim_harness import assert_bitwise
from torch import nn

import ruda_torch

STEPS = 12
INF_AT = {3, 4, 9}  # steps whose gradients overflow


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _run(scaler_cls, **opt_kw):
    model = _model()
    opt = ruda_torch.AdamW(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=1e-2,
                           fused_step=True, **opt_kw)  # fmt: skip
    scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=3)
    gen = torch.Generator().manual_seed(1)
    scales, steps_taken = [], []
    for step in range(STEPS):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if step in INF_AT:
            model[0].weight.grad[0, 0] = float("inf")
        before = model[2].bias.detach().clone()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        steps_taken.append(not torch.equal(before, model[2].bias))
    return model, scales, steps_taken


def test_same_skips_and_scale_schedule_as_torch_gradscaler_without_its_pass(monkeypatch):
    ours_model, ours_scales, ours_steps = _run(ruda_torch.amp.GradScaler, hierarchical_stats=True,
                                               max_grad_norm=1.0)  # fmt: skip
    torch_model, torch_scales, torch_steps = _run(torch.amp.GradScaler, hierarchical_stats=True,
                                                  max_grad_norm=1.0)  # fmt: skip
    assert ours_steps == torch_steps == [s not in INF_AT for s in range(STEPS)]
    assert ours_scales == torch_scales
    assert len(set(torch_scales)) > 2, "the schedule must both back off and grow"
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        assert_bitwise(a, b, "the same steps with the same scale")
    # torch's extra pass over the gradients is not run.
    calls = []
    original = torch.amp.GradScaler._check_inf_per_device
    monkeypatch.setattr(torch.amp.GradScaler, "_check_inf_per_device",
                        lambda self, opt: calls.append(1) or original(self, opt))  # fmt: skip
    _run(ruda_torch.amp.GradScaler, hierarchical_stats=True)
    assert not calls
    _run(torch.amp.GradScaler, hierarchical_stats=True)
    assert calls


def test_without_statistics_it_is_torchs_scaler():
    ours = _run(ruda_torch.amp.GradScaler)
    theirs = _run(torch.amp.GradScaler)
    assert ours[1] == theirs[1] and ours[2] == theirs[2]
    for a, b in zip(ours[0].parameters(), theirs[0].parameters(), strict=True):
        assert_bitwise(a, b, "no statistics: torch's path")


def test_after_unscale_it_is_torchs_scaler_and_step_twice_is_an_error():
    model = _model()
    opt = ruda_torch.AdamW(model.parameters(), fused_step=True, hierarchical_stats=True)
    scaler = ruda_torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 16)).sum()).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    scaler.update()
