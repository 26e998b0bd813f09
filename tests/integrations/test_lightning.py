"""PyTorch Lightning with ruda_torch.AdamW(fused_step=True) beside torch.optim.AdamW, in
`32-true` and `bf16-mixed` precision, and a checkpoint + resume that continues bit for
bit. Lightning refuses `gradient_clip_val` for optimizers that handle AMP scaling (torch's
fused AdamW too), so clipping is `max_grad_norm` of ruda_torch.AdamW (docs/integrations.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from training import TRAINING_ATOL, assert_trained_alike

import ruda_torch

L = pytest.importorskip("lightning.pytorch")

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
STEPS = 10


class Module(L.LightningModule):
    def __init__(self, make_opt):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        self.make_opt = make_opt

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return self.make_opt(self.parameters())


def _data():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 16, generator=gen)  # 5 batches: the step-5 checkpoint ends an epoch
    y = torch.randn(40, 4, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _trainer(tmp_path, precision, steps=STEPS, **kw):
    kw = {"enable_checkpointing": False, **kw}
    return L.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, precision=precision, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        **kw,
    )  # fmt: skip


def _ours(params):
    return ruda_torch.AdamW(params, **HYPER, fused_step=True, max_grad_norm=1.0)


def _theirs(params):
    return torch.optim.AdamW(params, **HYPER)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightning_trains_like_torch(tmp_path, precision):
    ours, theirs = Module(_ours), Module(_theirs)
    start = [p.detach().clone() for p in ours.parameters()]
    # torch's side clips as ours does, by the global norm (Lightning's own clipping).
    _trainer(tmp_path / "ours", precision).fit(ours, _data())
    _trainer(tmp_path / "torch", precision, gradient_clip_val=1.0).fit(theirs, _data())
    assert isinstance(ours.optimizers().optimizer, ruda_torch.AdamW)
    assert_trained_alike(ours, theirs, f"Lightning {precision}")
    moved = max((p.detach() - s).abs().max().item() for p, s in zip(ours.parameters(), start,
                                                                     strict=True))  # fmt: skip
    assert moved > 100 * TRAINING_ATOL


def test_lightning_refuses_gradient_clip_val_under_fp16_for_us_as_for_torch_fused(tmp_path):
    """The documented limit (docs/integrations.md): with a GradScaler (16-mixed), Lightning
    refuses gradient_clip_val for optimizers that unscale inside their step, torch's fused
    AdamW as ours; max_grad_norm of ruda_torch.AdamW clips instead, and trains."""
    fused = Module(lambda p: torch.optim.AdamW(p, **HYPER, fused=True))
    ours = Module(lambda p: ruda_torch.AdamW(p, **HYPER, fused_step=True))
    for module in (fused, ours):
        with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
            _trainer(tmp_path, "16-mixed", gradient_clip_val=1.0).fit(module, _data())
    clipped = Module(_ours)
    start = [p.detach().clone() for p in clipped.parameters()]
    _trainer(tmp_path, "16-mixed").fit(clipped, _data())
    assert all(torch.isfinite(p).all() for p in clipped.parameters())
    assert any(not torch.equal(p, s) for p, s in zip(clipped.parameters(), start, strict=True))


def test_lightning_checkpoint_resume_is_bit_identical(tmp_path):
    """A checkpoint taken by ModelCheckpoint at step 5 of a 10-step run, resumed with
    `fit(ckpt_path=...)`: the same parameters as the run that did not stop."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    straight = Module(_ours)
    saver = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=5, save_top_k=-1)
    _trainer(tmp_path / "a", "32-true", callbacks=[saver], enable_checkpointing=True).fit(
        straight, _data()
    )
    (ckpt,) = (tmp_path / "ckpt").glob("*step=5*.ckpt")
    state = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    assert state["param_groups"][0]["fused_step"] is True and state["state"], "our state_dict"
    resumed = Module(_ours)
    _trainer(tmp_path / "b", "32-true").fit(resumed, _data(), ckpt_path=str(ckpt))
    for (name, p), q in zip(resumed.named_parameters(), straight.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: the resumed run differs from the straight one"
