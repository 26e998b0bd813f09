"""Write fixtures/state8bit_v0/: checkpoints of the first 8-bit state format, for the
migration tests (tests/test_state_8bit_migration.py).

The first format (releases up to commit bc46cce) cut each rank's local codes into blocks
of 256 in their memory order: the scales of a plain tensor were 1-D, one per block of
the flat codes, and those of a DTensor parameter a DTensor of shape (m_1, ..., m_k, B),
one row per shard. It is written by that release, so the fixtures are its own bytes, not
an imitation: check out bc46cce, build it, and run this file with it first on the path:

    git worktree add /tmp/v0 bc46cce
    (cd /tmp/v0 && RUDA_TORCH_CUDA=0 python setup.py build_ext --inplace)
    PYTHONPATH=/tmp/v0 python tools/make_state8bit_v0_fixture.py

Written (about 1 MB):
- plain.pt: torch.save of {"model", "optim", "decoded"} after STEPS steps of one process,
  "decoded" the release's own ruda_torch.dequantize_state_dict of "optim" (its moments'
  FP32 values, what a loaded checkpoint must hold);
- fsdp2_2/: a distributed checkpoint (DCP) of {"model", "optim"} saved by two FSDP2 ranks
  (gloo) after STEPS steps, and fsdp2_2_decoded.pt: the full parameters and the full FP32
  values of every moment (the release's decoding, gathered), by parameter name.

The model, options and gradients are defined here once; the tests import them.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

FIXTURE_DIR = Path(__file__).resolve().parent.parent / "fixtures" / "state8bit_v0"
STEPS = 3
OPTIONS = dict(lr=1e-2, weight_decay=0.1, amsgrad=True, fused_step=True, state_precision="8bit",
               min_8bit_size=3000)  # fmt: skip


class Net(nn.Module):
    """Every layout of a slot: rows of whole blocks (whole), rows shorter than a block and
    not dividing it (rows33), rows of a block and a shorter one (rows300, cube), one row
    (flat: 1-D, 8-bit on one process, FP32 moments as a DTensor today), a transposed
    parameter (its codes laid out as it is), and one below min_8bit_size (small)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        for name, shape in SHAPES.items():
            t = torch.randn(shape, generator=gen) * 0.1
            if name == "transposed":
                t = t.t().contiguous().t()  # (70, 80) with strides (1, 70)
            setattr(self, name, nn.Parameter(t))


SHAPES = {"whole": (20, 256), "rows33": (130, 33), "rows300": (16, 300), "flat": (5000,),
          "cube": (6, 5, 100), "transposed": (70, 80), "small": (100,)}  # fmt: skip


def full_grad(name: str, shape, step: int) -> torch.Tensor:
    """The full gradient of parameter ``name`` at ``step``, with magnitudes over several
    binades (blocks of unequal scales)."""
    gen = torch.Generator().manual_seed(100 * step + list(SHAPES).index(name))
    return torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).pow(6)


def feed(model: nn.Module, step: int) -> None:
    """Every parameter's gradient, sharded like it (a DTensor parameter)."""
    for name, p in model.named_parameters():
        g = full_grad(name, p.shape, step)
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        elif not p.is_contiguous():
            g = g.t().contiguous().t()  # the parameter's layout
        p.grad = g


def shard(model: nn.Module, mesh) -> nn.Module:
    """The model under FSDP2 on ``mesh``, which takes contiguous parameters only (the
    transposed one made contiguous, the same values)."""
    from torch.distributed.fsdp import fully_shard

    model.transposed.data = model.transposed.data.contiguous()
    fully_shard(model, mesh=mesh)
    return model


def _plain() -> None:
    import ruda_torch

    model = Net()
    opt = ruda_torch.AdamW(model.parameters(), **OPTIONS)
    for step in range(STEPS):
        feed(model, step)
        opt.step()
    sd = opt.state_dict()
    out = {
        "model": model.state_dict(),
        "optim": sd,
        "decoded": ruda_torch.dequantize_state_dict(sd),
    }
    torch.save(out, FIXTURE_DIR / "plain.pt")


def _rank(rank: int, world: int, store: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    import ruda_torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = shard(Net(), init_device_mesh("cpu", (world,)))
    opt = ruda_torch.AdamW(model.parameters(), **OPTIONS)
    for step in range(STEPS):
        feed(model, step)
        opt.step()
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(sd, checkpoint_id=str(FIXTURE_DIR / f"fsdp2_{world}"))
    decoded = ruda_torch.dequantize_state_dict(opt.state_dict())["state"]
    full = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        entry = {
            k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in decoded[i].items()
        }
        full[name] = (p.full_tensor(), entry)
    if rank == 0:
        torch.save(full, FIXTURE_DIR / f"fsdp2_{world}_decoded.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    import ruda_torch

    if hasattr(ruda_torch.ops, "scales_shape_8bit"):
        print("this ruda_torch writes the row format: run with the release of commit bc46cce "
              "first on PYTHONPATH (see the docstring)", file=sys.stderr)  # fmt: skip
        return 2
    FIXTURE_DIR.mkdir(parents=True, exist_ok=True)
    _plain()
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store")), nprocs=2)
    for f in sorted(FIXTURE_DIR.rglob("*")):
        if f.is_file():
            print(f"{f.relative_to(FIXTURE_DIR.parent.parent)}: {f.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
