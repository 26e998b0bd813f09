"""``ruda_torch.AdamW`` under ``torch.compile`` (Note [Steps under torch.compile] in
ruda_torch/optimizer.py): a compiled training step that includes ``optimizer.step()``
gives the bits of eager steps, breaks the graph once for ruda_torch's step, and does not
recompile across 100 steps of an LR schedule (float or Tensor lr). (Bits are compared
for ``torch.compile(opt.step)`` with an eager model: a compiled forward and backward
give other gradient bits than eager ones, whatever the optimizer.) Counted with dynamo's
own counters, which are what ``TORCH_LOGS=graph_breaks,recompiles`` prints."""

from __future__ import annotations

import pytest
import torch
from optim_harness import assert_bitwise
from torch import nn
from torch._dynamo.utils import counters

import ruda_torch

SCHEDULES = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0 / (1 + k)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=200),
}


def _train(compiled: str, sched: str, lr, steps: int = 100):
    """compiled: "" (eager), "step" (torch.compile(opt.step), the model eager) or
    "train_step" (forward, backward and step compiled together)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    opt = ruda_torch.AdamW(model.parameters(), lr=lr, eps=1e-8, weight_decay=1e-2,
                           fused_step=True, max_grad_norm=1.0)  # fmt: skip
    schedule = SCHEDULES[sched](opt)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))

    def train_step():
        opt.zero_grad()
        loss = model(x).square().sum()
        loss.backward()
        opt.step()
        return loss

    opt_step = torch.compile(opt.step) if compiled == "step" else opt.step

    def step_only():
        opt.zero_grad()
        model(x).square().sum().backward()
        opt_step()

    step = {"": train_step, "step": step_only, "train_step": torch.compile(train_step)}[compiled]
    graphs = []
    for _ in range(steps):
        step()
        schedule.step()
        graphs.append(counters["stats"]["unique_graphs"])
    return model, graphs


def _lr(kind):
    return 1e-3 if kind == "float" else torch.tensor(1e-3, dtype=torch.float64)


def _ruda_breaks() -> list[str]:
    """Graph-break reasons that ruda_torch's code causes (not torch's own wrappers:
    zero_grad, backward, the LR scheduler's wrapper of opt.step)."""
    breaks = dict(counters["graph_break"])
    assert not any("ruda_torch._C" in msg for msg in breaks), "a C helper was traced"
    ours = [
        m for m in breaks if ("ruda_torch" in m or "AdamW._step" in m) and "lr_scheduler" not in m
    ]
    return ours


def _compiled(mode: str, sched: str, lr_kind: str):
    """A fresh dynamo, a 100-step run, no recompiles after the first steps; the model and
    ruda_torch's graph breaks."""
    torch._dynamo.reset()
    counters.clear()
    model, graphs = _train(mode, sched, _lr(lr_kind))
    assert graphs[4] == graphs[-1], f"recompiled after the first steps: {graphs[4]} -> {graphs[-1]}"
    return model, _ruda_breaks()


@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_compiled_opt_step_gives_eager_bits_without_recompiles(sched, lr_kind):
    compiled, ours = _compiled("step", sched, lr_kind)
    eager, _ = _train("", sched, _lr(lr_kind))
    for a, b in zip(compiled.parameters(), eager.parameters(), strict=True):
        assert_bitwise(a, b, f"{sched}: torch.compile(opt.step) vs eager")
    assert len(ours) <= 1 and all("AdamW._step" in m for m in ours), ours


@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_compiled_train_step_breaks_once_for_the_step_and_never_recompiles(sched, lr_kind):
    _, ours = _compiled("train_step", sched, lr_kind)
    # With a scheduler, torch's own wrapper of opt.step (lr_scheduler.py, force-skipped by
    # dynamo) already breaks there; ruda_torch adds at most its one excluded step.
    assert len(ours) <= 1 and all("AdamW._step" in m for m in ours), ours


def test_compiled_train_step_without_scheduler_breaks_once_for_the_step():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    opt = ruda_torch.AdamW(model.parameters(), lr=1e-3, fused_step=True)
    x = torch.randn(4, 16)

    @torch.compile
    def train_step():
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()

    for _ in range(20):
        train_step()
    ours = _ruda_breaks()
    assert len(ours) == 1 and "AdamW._step" in ours[0], ours


def test_flat_grads_under_compile_keep_eager_bits_and_views():
    """flat_grads=True: zero_grad (excluded from tracing like the step) and the step in a
    compiled training function; the gradients stay the flat buffer's views, and
    torch.compile(opt.step) gives the bits of the eager flat step."""

    def run(compiled: bool):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
        opt = ruda_torch.AdamW(model.parameters(), lr=1e-3, eps=1e-8, weight_decay=1e-2,
                               fused_step=True, flat_grads=True)  # fmt: skip
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
        opt_step = torch.compile(opt.step) if compiled else opt.step
        views = [p.grad for p in model.parameters()]
        for _ in range(10):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt_step()
        assert all(p.grad is v for p, v in zip(model.parameters(), views, strict=True))
        return model, _ruda_breaks()

    (compiled, ours), (eager, _) = run(True), run(False)
    for a, b in zip(compiled.parameters(), eager.parameters(), strict=True):
        assert_bitwise(a, b, "flat_grads: torch.compile(opt.step) vs eager")
    assert len(ours) == 1 and "AdamW._step" in ours[0], ours
