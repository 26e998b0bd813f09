"""DeepSpeed ZeRO 1 and 2 with ruda_torch.AdamW as the client optimizer, on the CPU
(DS_ACCELERATOR=cpu, gloo, 2 ranks), beside torch.optim.AdamW under the same config.

DeepSpeed flattens each param group and hands the client optimizer one FP32 partition
per group and rank, and its step assigns ``optimizer.param_groups = [group]`` for one
group at a time (Note [Swapped param_groups] in ruda_torch/optimizer.py). Checked:
* the plain fused step and DeepSpeed's own ``gradient_clipping`` train like torch AdamW,
  with two param groups (other weight decays), for stage 1 and stage 2;
* ``max_grad_norm`` with two param groups is refused with an error that names
  DeepSpeed's ``gradient_clipping`` (a norm per group would be silently wrong);
* ``max_grad_norm`` with one group and ``partition_group`` (the ranks' partitions are
  disjoint parts of the model) clips by the global norm, like ``gradient_clipping``.
`make test-integrations` installs DeepSpeed (requirements-deepspeed.txt and the Makefile).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytest.importorskip("deepspeed")

WORLD = 2
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
CLIP = 0.05  # below every step's norm here
STEPS = 4


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 14), torch.nn.Tanh(), torch.nn.Linear(14, 5))


def _groups(model, n_groups: int):
    ps = list(model.parameters())
    if n_groups == 1:
        return [{"params": ps}]
    return [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]


def _train(rank: int, make_opt, n_groups: int, stage: int, ds_clip: float | None):
    import deepspeed

    model = _model()
    opt = make_opt(_groups(model, n_groups))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    if ds_clip is not None:
        config["gradient_clipping"] = ds_clip
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 9, generator=g), torch.randn(8, 5, generator=g)
        rows = slice(rank * 4, (rank + 1) * 4)
        engine.backward((engine(x[rows]) - y[rows]).square().mean())
        engine.step()
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
    )  # fmt: skip
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    import ruda_torch

    deepspeed.init_distributed(dist_backend="gloo")

    def theirs(groups):
        return torch.optim.AdamW(groups, **HYPER, foreach=False)

    def ours(**kw):
        return lambda groups: ruda_torch.AdamW(groups, **HYPER, fused_step=True, **kw)

    def close(a, b, what):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=2e-6, atol=1e-7, msg=what)

    for stage in (1, 2):
        for ds_clip in (None, CLIP):
            what = f"stage {stage}, gradient_clipping={ds_clip}"
            close(_train(rank, ours(), 2, stage, ds_clip),
                  _train(rank, theirs, 2, stage, ds_clip), what)  # fmt: skip
        with pytest.raises(ValueError, match='DeepSpeed.*"gradient_clipping"'):
            _train(rank, ours(max_grad_norm=CLIP), 2, stage, None)
        world = dist.group.WORLD
        close(_train(rank, ours(max_grad_norm=CLIP, partition_group=world), 1, stage, None),
              _train(rank, theirs, 1, stage, CLIP), f"stage {stage}, max_grad_norm")  # fmt: skip
        # Without partition_group the norm is this rank's partition only: different.
        local = _train(rank, ours(max_grad_norm=CLIP), 1, stage, None)
        assert any(not torch.allclose(a, b, rtol=1e-4, atol=0) for a, b in
                   zip(local, _train(rank, theirs, 1, stage, CLIP), strict=True))  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_deepspeed_zero_with_ruda_torch_adamw():
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(_free_port(),), nprocs=WORLD, start_method="spawn")
