"""8-bit moments are the same on every mesh (Note [8-bit blocks on every mesh] in
ruda_torch/_state8bit.py): fed the same full gradients, an 8-bit optimizer on 1, 2 and 4
FSDP2 ranks, on HSDP 2x2 and on FSDP2 + tensor parallelism 2x2 holds the bits of a single
process's plain-tensor run after every step (parameters, codes, scales, FP32 moments,
counters: the full tensors); and a distributed checkpoint (DCP) saved on 4 ranks loads on
2, then 1, then 4 again, each time bit for bit, and training continues on the same bits.
A sharding that would cut blocks is refused before anything changes, naming the
parameter. gloo on the CPU, launched by tests/test_distributed.py's ``run_scenario``.

The model's 8-bit parameters cover each way a slot is laid out: ``up.weight`` (512, 9),
rows of 9 (a block each, laid out in rows on whole blocks); ``down.weight`` (9, 512), rows
of two blocks, which Rowwise tensor parallelism cuts into whole blocks; ``cube``
(6, 5, 100), rows of 500 elements (a block and a shorter one), sharded 2 + 2 + 2 + 0 rows
on 4 ranks. The biases (1-D, below ``min_8bit_size``) keep FP32 moments.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_distributed import run_scenario
from test_ops import same_bits
from torch import nn

import ruda_torch

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(),
        reason="torch.distributed with the gloo backend is not available",
    ),
]

D, H = 9, 512
OPTIONS = dict(lr=1e-2, weight_decay=0.1, amsgrad=True, fused_step=True, state_precision="8bit",
               min_8bit_size=1000)  # fmt: skip


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(77)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)
        self.cube = nn.Parameter(torch.randn(6, 5, 100) * 0.1)


NAMES = [n for n, _ in Net().named_parameters()]


def full_grad(name: str, shape, step: int) -> torch.Tensor:
    """The full gradient of parameter ``name`` at ``step``: the same on every rank, with
    magnitudes over several binades (blocks of unequal scales)."""
    gen = torch.Generator().manual_seed(1000 * step + NAMES.index(name))
    return torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).pow(6)


def feed(model: nn.Module, step: int) -> None:
    """Every parameter's gradient: its full gradient, sharded like the parameter."""
    from torch.distributed.tensor import distribute_tensor

    for name, p in model.named_parameters():
        g = full_grad(name, p.shape, step)
        if hasattr(p, "device_mesh"):
            g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = g


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def full_state(model: nn.Module, opt) -> dict:
    """Every parameter and its state entry, unsharded (a collective), by name."""
    return {
        name: (_full(p), {k: _full(v) for k, v in sorted(opt.state[p].items())})
        for name, p in model.named_parameters()
    }


def options(precision: str) -> dict:
    """OPTIONS with ``precision``'s moments: "4bit" keeps ``up.weight`` (an odd last
    dimension) in 8 bits and the others in 4 (Note [4-bit buckets] in
    ruda_torch/_state4bit.py)."""
    return {**OPTIONS, "state_precision": precision}


def reference(steps: int, precision: str = "8bit") -> list[dict]:
    """A single process's plain-tensor run: full_state() after each step."""
    model = Net()
    opt = ruda_torch.AdamW(model.parameters(), **options(precision))
    out = []
    for step in range(steps):
        feed(model, step)
        opt.step()
        out.append(full_state(model, opt))
    return out


def assert_same_state(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, (p, entry) in want.items():
        assert same_bits(got[name][0], p), f"{what}: {name}"
        assert got[name][1].keys() == entry.keys(), f"{what}: {name} {sorted(got[name][1])}"
        for key, value in entry.items():
            assert same_bits(got[name][1][key], value), f"{what}: {name}[{key!r}]"


def build(layout: str) -> nn.Module:
    """The model on this rank's mesh: FSDP2 over every rank, HSDP (replicate=2, shard=2),
    or FSDP2 over "dp" on top of tensor parallelism over "tp" (2x2: up Colwise, so its dp
    placement is _StridedShard(0); down Rowwise, Shard(1) on tp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Net()
    world = dist.get_world_size()
    if layout == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        full = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, full["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        mesh = full["dp"]
    for layer in (model.up, model.down):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


STEPS = 3


def scenario_same_bits(rank: int, workdir: str, layout: str, precision: str = "8bit") -> None:
    want = reference(STEPS, precision)
    model = build(layout)
    opt = ruda_torch.AdamW(model.parameters(), **options(precision))
    for step in range(STEPS):
        feed(model, step)
        opt.step()
        assert_same_state(full_state(model, opt), want[step], f"{layout} step {step}")
    # The format itself: codes shaped and sharded like the parameter, scales of the rows'
    # blocks sharded like it.
    ops = ruda_torch.ops
    for p in (model.up.weight, model.down.weight, model.cube):
        st = opt.state[p]
        if precision == "4bit" and p is not model.up.weight:
            codes, scales = st["exp_avg_codes4"], st["exp_avg_scales4"]
            assert codes.placements == p.placements
            assert tuple(codes.shape) == ops.codes_shape_4bit(p.shape)
            assert tuple(scales.shape) == ops.scales_shape_4bit(p.shape)
            assert scales.placements == p.placements
            continue
        codes, scales = st["exp_avg_codes"], st["exp_avg_scales"]
        assert codes.placements == p.placements and codes.shape == p.shape
        assert scales.placements == p.placements
        assert tuple(scales.shape) == ops.scales_shape_8bit(p.shape)
    assert "exp_avg" in opt.state[model.up.bias]  # 1-D: FP32 moments


@pytest.mark.parametrize("precision", ["8bit", "4bit"])
@pytest.mark.parametrize(
    "layout, world",
    [("fsdp2", 1), ("fsdp2", 2), ("fsdp2", 4), ("hsdp", 4), ("tensor-parallel", 4)],
    ids=["fsdp2-1", "fsdp2-2", "fsdp2-4", "hsdp-2x2", "fsdp2-tp-2x2"],
)
def test_coded_state_has_the_same_bits_on_every_mesh(tmp_path, layout, world, precision):
    run_scenario(tmp_path, "test_state_8bit_mesh:scenario_same_bits", world=world,
                 layout=layout, precision=precision)  # fmt: skip


def scenario_dcp_phase(rank: int, workdir: str, load: str | None, save: str, first: int,
                       steps: int, precision: str = "8bit") -> None:  # fmt: skip
    """Load ``load`` (a DCP checkpoint of the state after step ``first - 1``; None: start
    afresh), check it against the single process's bits, train ``steps`` steps checking
    each, save to ``save``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    want = reference(first + steps, precision)
    model = build("fsdp2")
    opt = ruda_torch.AdamW(model.parameters(), **options(precision))
    world = dist.get_world_size()
    if load is not None:
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=load)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        assert_same_state(full_state(model, opt), want[first - 1], f"loaded on {world} ranks")
    for step in range(first, first + steps):
        feed(model, step)
        opt.step()
        assert_same_state(full_state(model, opt), want[step], f"{world} ranks, step {step}")
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(sd, checkpoint_id=save)


@pytest.mark.parametrize("precision", ["8bit", "4bit"])
def test_dcp_checkpoint_reshards_4_2_1_4(tmp_path, precision):
    """Saved on 4 FSDP2 ranks, loaded on 2, saved, loaded on 1, saved, loaded on 4 (and the
    2 ranks' checkpoint loaded on 4 too): every load holds the saved bits and every step
    after it the single process's."""
    phases = [(4, None, "a", 0, 2), (2, "a", "b", 2, 1), (1, "b", "c", 3, 1), (4, "c", "d", 4, 1),
              (4, "b", "e", 3, 1)]  # fmt: skip
    for world, load, save, first, steps in phases:
        where = tmp_path / f"run-{save}"
        where.mkdir()
        run_scenario(where, "test_state_8bit_mesh:scenario_dcp_phase", world=world,
                     load=None if load is None else str(tmp_path / load),
                     save=str(tmp_path / save), first=first, steps=steps,
                     precision=precision)  # fmt: skip


def scenario_cut_blocks(rank: int, workdir: str) -> None:
    """Rowwise tensor parallelism over rows of 9 x 14 elements cuts blocks (7 columns a
    shard): refused at the first step, naming the parameter, before anything changes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    model = nn.Sequential(nn.Linear(14, 9))
    parallelize_module(model, mesh, {"0": RowwiseParallel()})
    w = model[0].weight
    opt = ruda_torch.AdamW([w], **{**OPTIONS, "min_8bit_size": 1})
    before = _full(w)
    w.grad = torch.distributed.tensor.distribute_tensor(torch.ones(9, 14), mesh, w.placements,
                                                        src_data_rank=None)  # fmt: skip
    with pytest.raises(ValueError, match=r"param group 0 parameter 0: .*Shard\(dim=1\).* cuts"):
        opt.step()
    assert same_bits(_full(w), before) and not opt.state


def test_a_sharding_that_cuts_blocks_is_refused(tmp_path):
    run_scenario(tmp_path, "test_state_8bit_mesh:scenario_cut_blocks", world=2)


def scenario_dtensor_entries(rank: int, workdir: str) -> None:
    """Entries of DTensor parameters (FSDP2, 2 ranks; Note [8-bit entry formats] in
    ruda_torch/_state8bit.py): scales of another global shape, of the rows' shape placed
    otherwise than the codes, and of the first format's layout but for a mesh of other
    sizes, are each refused on every rank before anything changes; the first format's own
    layout loads as its blocks say."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    model = build("fsdp2")
    opt = ruda_torch.AdamW(model.parameters(), **OPTIONS)
    feed(model, 0)
    opt.step()
    w = model.up.weight  # (512, 9): a block per row, Shard(0): 256 rows a rank
    mesh, entry = w.device_mesh, opt.state[w]
    before = full_state(model, opt)
    scales = entry["exp_avg_scales"]
    local = scales.to_local()
    spoiled = {
        "flattened": (DTensor.from_local(local.reshape(-1), mesh, [Shard(0)], run_check=False),
                      r"has shape \(512,\); .* have shape \(512, 1\) or \(2, 9\)"),
        "replicated": (DTensor.from_local(scales.full_tensor(), mesh, [Replicate()],
                                          run_check=False), "placed"),
        "first-format-4-blocks": (DTensor.from_local(torch.zeros(1, 4), mesh, [Shard(0)],
                                                     run_check=False),
                                  r"has shape \(2, 4\); .* \(2, 9\) \(the first"),
    }  # fmt: skip
    for what, (value, match) in spoiled.items():
        opt.state[w] = {**entry, "exp_avg_scales": value}
        feed(model, 1)
        with pytest.raises(ValueError, match=match):
            opt.step()
        opt.state[w] = entry
        assert_same_state(full_state(model, opt), before, what)
    # The first format as 2 ranks saved it: each rank's 256 x 9 codes in blocks of their
    # memory order, one row of 9 scales (2,304 codes) a rank.
    codes = entry["exp_avg_codes"].to_local()
    values = ruda_torch.ops.dequantize_8bit(codes, local, "signed")
    first_codes, first_scales = ruda_torch.ops.quantize_8bit(values.reshape(-1), "signed")
    first = {
        **entry,
        "exp_avg_codes": DTensor.from_local(first_codes.reshape(codes.shape), mesh, [Shard(0)],
                                            run_check=False, shape=w.shape, stride=w.stride()),
        "exp_avg_scales": DTensor.from_local(first_scales.reshape(1, -1), mesh, [Shard(0)],
                                             run_check=False),
    }  # fmt: skip
    want = ruda_torch.ops.dequantize_8bit(first_codes, first_scales, "signed").reshape(codes.shape)
    got = ruda_torch.dequantize_state_dict({"state": {0: first}, "param_groups": []})
    assert same_bits(got["state"][0]["exp_avg"].to_local(), want)
    opt.state[w] = first
    opt._current_plan()  # adopted: re-coded by the rows
    decoded = ruda_torch.ops.dequantize_8bit(
        *ruda_torch.ops.quantize_8bit(want, "signed"), "signed"
    )
    mine = opt.state[w]
    assert same_bits(ruda_torch.ops.dequantize_8bit(mine["exp_avg_codes"].to_local(),
                                                    mine["exp_avg_scales"].to_local(), "signed"),
                     decoded)  # fmt: skip


def test_dtensor_entries_of_no_format_are_refused(tmp_path):
    run_scenario(tmp_path, "test_state_8bit_mesh:scenario_dtensor_entries", world=2)
