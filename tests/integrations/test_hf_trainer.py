"""transformers.Trainer with ruda_torch.AdamW(fused_step=True) beside torch.optim.AdamW:
`optimizers=(opt, sched)` and `optimizer_cls_and_kwargs`, `max_grad_norm`, and a save +
`resume_from_checkpoint` that continues bit for bit."""

from __future__ import annotations

import pytest
import torch
from training import TRAINING_ATOL, assert_trained_alike

import ruda_torch

transformers = pytest.importorskip("transformers")

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
STEPS = 10


def _model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


class _Data(torch.utils.data.Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 97, (64, 16), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(tmp_path, **kw):
    args = dict(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=8,
        learning_rate=HYPER["lr"], weight_decay=HYPER["weight_decay"], adam_epsilon=HYPER["eps"],
        max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=2, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, save_strategy="no",
        disable_tqdm=True,
    )  # fmt: skip
    return transformers.TrainingArguments(**{**args, **kw})


def _train(tmp_path, make_opt=None, cls_kwargs=None, **kw):
    model = _model()
    extra = {}
    if make_opt is not None:
        opt = make_opt(model.parameters())
        sched = transformers.get_linear_schedule_with_warmup(opt, 2, STEPS)
        extra["optimizers"] = (opt, sched)
    if cls_kwargs is not None:
        extra["optimizer_cls_and_kwargs"] = cls_kwargs
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, **kw),
                                   train_dataset=_Data(), **extra)  # fmt: skip
    trainer.train(**({"resume_from_checkpoint": kw.pop("resume")} if "resume" in kw else {}))
    return model, trainer


def _ours(params):
    return ruda_torch.AdamW(params, **HYPER, fused_step=True)


def _theirs(params):
    return torch.optim.AdamW(params, **HYPER)


def _compare(a, b, what):
    assert_trained_alike(a, b, what)
    moved = max((p.detach() - q.detach()).abs().max().item()
                for p, q in zip(a.parameters(), _model().parameters(), strict=True))  # fmt: skip
    assert moved > 100 * TRAINING_ATOL, "the runs did not train"


def test_trainer_with_optimizers_tuple_trains_like_torch(tmp_path):
    ours, trainer = _train(tmp_path / "ours", _ours)
    theirs, _ = _train(tmp_path / "torch", _theirs)
    assert isinstance(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                      else trainer.optimizer, ruda_torch.AdamW)  # fmt: skip
    _compare(ours, theirs, "optimizers=(opt, sched)")


def test_trainer_with_optimizer_cls_and_kwargs(tmp_path):
    ours, _ = _train(tmp_path / "ours", cls_kwargs=(ruda_torch.AdamW, dict(HYPER, fused_step=True)))
    theirs, _ = _train(tmp_path / "torch", cls_kwargs=(torch.optim.AdamW, dict(HYPER)))
    _compare(ours, theirs, "optimizer_cls_and_kwargs")


@pytest.mark.parametrize(
    "options", [{}, dict(state_precision="8bit", min_8bit_size=1)], ids=["fp32", "8bit"]
)
def test_trainer_resume_from_checkpoint_is_bit_identical(tmp_path, options):
    """The Trainer's optimizer.pt (torch.save, then torch.load with weights_only) resumes
    bit for bit, FP32 moments or 8-bit codes and scales alike."""
    cls = (ruda_torch.AdamW, dict(HYPER, fused_step=True, **options))
    straight, _ = _train(tmp_path / "straight", cls_kwargs=cls)
    first = transformers.Trainer(
        model=_model(), args=_args(tmp_path / "resumed", save_strategy="steps", save_steps=5),
        train_dataset=_Data(), optimizer_cls_and_kwargs=cls,
    )  # fmt: skip
    first.train()
    checkpoint = tmp_path / "resumed" / "checkpoint-5"
    assert (checkpoint / "optimizer.pt").exists()
    model = _model()
    second = transformers.Trainer(model=model, args=_args(tmp_path / "resumed2"),
                                  train_dataset=_Data(), optimizer_cls_and_kwargs=cls)  # fmt: skip
    second.train(resume_from_checkpoint=str(checkpoint))
    for (name, p), q in zip(model.named_parameters(), straight.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: the resumed run differs from the straight one"


def test_trainer_with_flat_grads_gives_the_bits_of_flat_grads_false(tmp_path):
    """The Trainer resets gradients with model.zero_grad() (None): flat_grads notices,
    steps them where they are, warns once, and trains bit for bit as without it."""
    plain, _ = _train(
        tmp_path / "plain", cls_kwargs=(ruda_torch.AdamW, dict(HYPER, fused_step=True))
    )
    with pytest.warns(UserWarning, match="model.zero_grad"):
        flat, _ = _train(tmp_path / "flat", cls_kwargs=(ruda_torch.AdamW,
                         dict(HYPER, fused_step=True, flat_grads=True)))  # fmt: skip
    for p, q in zip(flat.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
