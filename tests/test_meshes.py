"""The global gradient norm on every mesh layout (Note [Scopes] in ruda_torch/distributed.py):
FSDP2 + tensor parallelism on a 2x2 ("dp", "tp") mesh, HSDP with replicate=2 x shard=2,
pipeline stages joined by ``partition_group`` (alone and over FSDP2), and
ZeroRedundancyOptimizer checkpoints with ``partition_group``. gloo on the CPU, launched by
tests/test_distributed.py's ``run_scenario``.

Every layout is checked the same way (``check_layout``), on every rank, for the three ways
of clipping: the native statistics (``hierarchical_stats`` + ``max_grad_norm``), the
tensor-operation norm (``max_grad_norm`` alone, fused step) and the generic path
(``fused_step=False``):
* the global norm of every step equals the norm of the whole model's gradients, computed
  from the full tensors in FP64 (and, where torch's own ``clip_grad_norm_`` runs on the
  layout, torch's too) within NORM_RTOL, and the report has the same bits on every rank;
* several clipped steps follow a single-process ``torch.optim.AdamW`` +
  ``clip_grad_norm_`` run of the unsharded model on the same global batches (Note
  [Distributed tolerance] in tests/test_distributed.py);
* one non-finite element in one rank's shard (and, with the statistics, in one rank's copy
  of a replicated parameter) skips the step on every rank, bit for bit.
Before the fix of this file's issue, the tensor-parallel layout's norm was 5-6.5% low and
its dp halves clipped differently (``_StridedShard`` was taken for a copy), and a group
that mixed placements was refused on the fused path.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_distributed import (
    HP,
    VS_SINGLE_PROCESS,
    WORLD,
    assert_same_bits,
    run_scenario,
    same_bits,
)
from test_distributed import (
    reference_run as _reference_run,
)
from torch import nn

import ruda_torch

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(),
        reason="torch.distributed with the gloo backend is not available",
    ),
]

STEPS = 3
MAX_GRAD_NORM = 0.05  # below every step's norm here: every step clips
NORM_RTOL = 1e-5  # the norms differ by FP32 summation order only (~1e-7 measured)
D, H, OUT = 9, 14, 6  # odd sizes: uneven shards over dp (e.g. 7 rows over 2 ranks: 4 + 3)
GLOBAL_BATCH = 8
OPTIONS = {  # the three ways of clipping
    "stats": dict(fused_step=True, hierarchical_stats=True),
    "tensor-norm": dict(fused_step=True),
    "generic": dict(fused_step=False),
}


# --------------------------------------------------------------------------- model and data


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def make_model() -> nn.Sequential:
    torch.manual_seed(4321)
    model = nn.Sequential(Block(), Block(), nn.Linear(D, OUT))
    with torch.no_grad():  # LayerNorm starts at (1, 0): make its gradients less special
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.1)
    return model


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, D, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def loss_fn(out, y):
    return (out - y).square().mean()


def reference_run(steps: int):
    """Single process: torch.optim.AdamW + clip_grad_norm_ on the whole model and the
    global batch (tests/test_distributed.py's, with this file's model and data)."""
    return _reference_run(steps, make=make_model, batch=global_batch, loss=loss_fn,
                          max_norm=MAX_GRAD_NORM)  # fmt: skip


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def world_gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


# --------------------------------------------------------------------------- layouts
# A layout builds the model on this rank and says how to feed it: (model, the rows of the
# global batch this rank trains on, the parameters' full values by single-process name,
# whether torch's clip_grad_norm_ runs on the layout, and a "forward-backward" function).


def _rows(dp_rank: int, dp_size: int) -> slice:
    n = GLOBAL_BATCH // dp_size
    return slice(dp_rank * n, (dp_rank + 1) * n)


class Layout:
    torch_clip = True

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: _full(p).detach().clone() for n, p in self.model.named_parameters()}

    def params(self) -> list:
        return list(self.model.parameters())

    def backward(self, step: int) -> None:
        x, y = global_batch(step)
        dtype = next(self.model.parameters()).dtype  # a BF16 model takes BF16 inputs
        loss_fn(self.model(x[self.rows].to(dtype)).float(), y[self.rows]).backward()


class TensorParallel(Layout):
    """FSDP2 over "dp" on top of tensor parallelism over "tp" (2x2, 4 ranks): up and the
    head Colwise (their dp placement is _StridedShard), down Rowwise (its bias Replicate on
    tp), the LayerNorms Replicate on tp; one param group mixes all these scopes."""

    def __init__(self, rank: int, dtype=None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor, Replicate, distribute_module
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]

        def replicate_in(_module, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Replicate()]) for x in inputs)

        def local_out(_module, out, _mesh):
            return out.to_local()

        model = make_model() if dtype is None else make_model().to(dtype)
        for block in model[:2]:
            parallelize_module(block, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            distribute_module(block.norm, tp, input_fn=replicate_in, output_fn=local_out)
        parallelize_module(model[2], tp, ColwiseParallel(output_layouts=Replicate()))
        for block in model[:2]:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        self.model = model
        self.rows = _rows(mesh["dp"].get_local_rank(), 2)
        placements = {str(p.placements) for p in model.parameters()}
        assert any("_StridedShard" in s for s in placements), placements  # the case at hand
        assert any("Replicate" in s for s in placements), placements


class HSDP(Layout):
    """fully_shard on a (replicate=2, shard=2) mesh: placements (Replicate, Shard(0)),
    uneven shards; every rank trains on its own quarter of the batch."""

    def __init__(self, rank: int, dtype=None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = make_model() if dtype is None else make_model().to(dtype)
        for block in model[:2]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.rows = _rows(rank, 4)


class Pipeline(Layout):
    """Two stages: stage s (the pp coordinate) owns the layers of one half of the model
    and nothing else; activations and their gradients go between stages by send/recv.
    With dp > 1 every stage is FSDP2-sharded over its dp group. The stages are joined by
    ``partition_group`` (the pp group); torch's clip_grad_norm_ cannot see the other
    stage, so only the full-tensor norm is compared."""

    torch_clip = False

    def __init__(self, rank: int, dp: int):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, dp), mesh_dim_names=("pp", "dp"))
        self.stage = mesh["pp"].get_local_rank()
        dp_rank = mesh["dp"].get_local_rank()
        self.peer = mesh["pp"].mesh.tolist()[1 - self.stage]  # same dp coordinate
        full = make_model()
        keep = ["0"] if self.stage == 0 else ["1", "2"]
        self.names = [n for n, _ in full.named_parameters() if n.split(".")[0] in keep]
        self.model = nn.Sequential(*[full[int(i)] for i in keep])
        self.prefix = {str(j): i for j, i in enumerate(keep)}
        if dp > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in self.model:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(self.model, mesh=mesh["dp"])
        self.partition_group = mesh["pp"].get_group()
        self.rows = _rows(dp_rank, dp)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Both stages' parameters on every rank (one object gather)."""
        mine = {}
        for n, p in self.model.named_parameters():
            head, rest = n.split(".", 1)
            mine[f"{self.prefix[head]}.{rest}"] = _full(p).detach().clone()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {k: v for d in everyone for k, v in d.items()}

    def backward(self, step: int) -> None:
        x, y = global_batch(step)
        x, y = x[self.rows], y[self.rows]
        if self.stage == 0:
            out = self.model(x)
            dist.send(out.detach().contiguous(), self.peer)
            grad = torch.empty_like(out)
            dist.recv(grad, self.peer)
            out.backward(grad)
        else:
            act = torch.empty(x.shape[0], D)
            dist.recv(act, self.peer)
            act.requires_grad_(True)
            loss_fn(self.model(act), y).backward()
            dist.send(act.grad.contiguous(), self.peer)


LAYOUTS = {
    "tensor-parallel": lambda rank, dtype=None: TensorParallel(rank, dtype),
    "hsdp": lambda rank, dtype=None: HSDP(rank, dtype),
    "pipeline": lambda rank: Pipeline(rank, dp=1),
    "pipeline-fsdp2": lambda rank: Pipeline(rank, dp=2),
}


def true_norm(layout: Layout) -> float:
    """sqrt of the sum of the squares of every full gradient of the whole model, FP64."""
    sq = torch.zeros((), dtype=torch.float64)
    for p in layout.params():
        if p.grad is not None:
            sq += _full(p.grad).double().square().sum()
    group = getattr(layout, "partition_group", None)
    if group is not None:
        dist.all_reduce(sq, group=group)
    return sq.sqrt().item()


# --------------------------------------------------------------------------- scenarios


def check_layout(rank: int, workdir: str, layout_name: str, options: str) -> None:
    ref_norms, ref_params = reference_run(STEPS)
    layout = LAYOUTS[layout_name](rank)
    group = getattr(layout, "partition_group", None)
    opt = ruda_torch.AdamW(layout.params(), **HP, **OPTIONS[options],
                           max_grad_norm=MAX_GRAD_NORM, partition_group=group)  # fmt: skip
    stats = options == "stats"
    for step in range(STEPS):
        layout.backward(step)
        truth = true_norm(layout)
        assert truth == pytest.approx(ref_norms[step], rel=NORM_RTOL), (step, truth, ref_norms)
        if layout.torch_clip:  # torch's own norm of the same DTensor gradients
            theirs = torch.nn.utils.get_total_norm([p.grad for p in layout.params()])
            assert _full(theirs).item() == pytest.approx(truth, rel=NORM_RTOL)
        opt.step()
        if stats:
            report = opt.last_report
            norm = report.grad_norm.item()
            assert norm == pytest.approx(truth, rel=NORM_RTOL), (layout_name, step, norm, truth)
            assert norm > 2 * MAX_GRAD_NORM and report.clip_coef.item() < 1  # it clips
            for r, other in enumerate(world_gather(report.tensor)):
                assert same_bits(other, report.tensor), (step, r, other, report.tensor)
        opt.zero_grad(set_to_none=True)
    params = layout.full_params()
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, **VS_SINGLE_PROCESS, msg=name)
    # Every rank applied the same clip coefficient: the parameters' copies agree.
    mine = torch.cat([p.reshape(-1) for p in params.values()])
    for other in world_gather(mine):
        assert same_bits(other, mine), "ranks hold different full parameters"

    if not stats:
        return

    # One non-finite element in one rank's part: every rank skips. First in a split
    # parameter on the last rank, then (where the layout has copies) in one rank's copy.
    def copied(p) -> bool:
        return "Replicate" in str(getattr(p, "placements", ""))

    targets = [(what, pick) for what, pick in (("split", lambda p: not copied(p)),
                                               ("copy", copied))
               if any(pick(p) for p in layout.params())]  # fmt: skip
    for what, pick in targets:
        layout.backward(STEPS)
        if rank == dist.get_world_size() - 1:
            g = next(_local(p.grad) for p in layout.params()
                     if pick(p) and p.grad is not None and _local(p.grad).numel())  # fmt: skip
            g.view(-1)[0] = float("nan")
        before = [_local(p).detach().clone() for p in layout.params()]
        opt.step()
        report = opt.last_report
        assert report.skipped.item(), (what, report.tensor)
        assert report.nonfinite_count.item() >= 1, (what, report.tensor)
        for other in world_gather(report.tensor):
            assert same_bits(other, report.tensor), (what, other, report.tensor)
        after = [_local(p).detach() for p in layout.params()]
        assert_same_bits(after, before, f"parameters after a NaN in one rank's {what}")
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("layout", ["tensor-parallel", "hsdp", "pipeline-fsdp2"])
def test_global_norm_on_four_ranks(tmp_path, layout, options):
    run_scenario(tmp_path, "test_meshes:check_layout", world=4, layout_name=layout,
                 options=options)  # fmt: skip


@pytest.mark.parametrize("options", sorted(OPTIONS))
def test_global_norm_over_two_pipeline_stages(tmp_path, options):
    run_scenario(tmp_path, "test_meshes:check_layout", world=WORLD, layout_name="pipeline",
                 options=options)  # fmt: skip


def scenario_zero_checkpoint(rank: int, workdir: str) -> None:
    """ZeroRedundancyOptimizer with ``partition_group``: ZeRO copies every keyword into
    its group dicts and syncs them into ours and back, so the process group must not reach
    a state dict. Consolidate, torch.save on rank 0 (pickles), torch.load with
    weights_only=True on every rank into a fresh model and ZeRO, continue: bit-identical to
    the uninterrupted run, with the global norm of both ranks' partitions."""
    import os

    from torch.distributed.optim import ZeroRedundancyOptimizer

    path = os.path.join(workdir, "zero.pt")
    kwargs = dict(HP, fused_step=True, hierarchical_stats=True, max_grad_norm=MAX_GRAD_NORM,
                  partition_group=dist.group.WORLD)  # fmt: skip

    def build():
        model = make_model()
        return model, ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=ruda_torch.AdamW, **kwargs
        )

    def train(model, opt, steps):
        norms = []
        for step in steps:
            opt.zero_grad(set_to_none=True)
            x, y = global_batch(step)
            loss_fn(model(x), y).backward()
            opt.step()
            norms.append(opt.optim.last_report.tensor.clone())
        return norms

    model, opt = build()
    local_groups = opt.optim.param_groups
    assert all(g["partition_group"] == tuple(range(WORLD)) for g in local_groups)
    train(model, opt, range(2))
    import pickle

    pickle.dumps(opt.optim.state_dict())  # our own state dict, on every rank
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save(opt.state_dict(), path)
    dist.barrier()
    ref_norms, _ = reference_run(STEPS + 2)
    straight = train(model, opt, range(2, STEPS + 2))
    for step, report in zip(range(2, STEPS + 2), straight, strict=True):
        norm = report[0].sqrt().item()
        assert norm == pytest.approx(ref_norms[step], rel=NORM_RTOL), (step, norm)
    final = [p.detach().clone() for p in model.parameters()]

    model, opt = build()
    saved = torch.load(path, weights_only=True)
    assert saved["param_groups"][0]["partition_group"] == tuple(range(WORLD))
    # The parameters of the checkpoint: the straight run's after step 2, replayed.
    replay, replay_opt = build()
    train(replay, replay_opt, range(2))
    with torch.no_grad():
        for p, q in zip(model.parameters(), replay.parameters(), strict=True):
            p.copy_(q)
    opt.load_state_dict(saved)
    resumed = train(model, opt, range(2, STEPS + 2))
    assert_same_bits(resumed, straight, "reports after the resume")
    assert_same_bits([p.detach() for p in model.parameters()], final, "parameters after resume")


def test_zero_checkpoint_with_partition_group(tmp_path):
    run_scenario(tmp_path, "test_meshes:scenario_zero_checkpoint", world=WORLD)


def scenario_placement_meaning(rank: int, workdir: str) -> None:
    """The scope comes from what a placement means: a placement torch might add tomorrow
    (neither Shard, Replicate nor Partial) splits the parameter; Replicate copies it;
    Partial is refused with what to do; a mesh dimension of one rank combines nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor.placement_types import Placement

    from ruda_torch.distributed import scope_of

    class Tomorrow(Placement):  # not a Shard subclass, as _StridedShard in torch 2.13
        pass

    class Fake:  # the two attributes that scope_of reads of a DTensor
        def __init__(self, mesh, placements):
            self.device_mesh, self.placements = mesh, placements

    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("a", "b"))
    both = tuple(range(WORLD))
    scope = scope_of(Fake(mesh, (Tomorrow(), Replicate())), None, True, "p")
    assert scope.key == ((both,), ()), scope.describe()
    scope = scope_of(Fake(mesh, (Replicate(), Tomorrow())), None, True, "p")
    assert scope.key == ((), (both,)), scope.describe()
    with pytest.raises(ValueError, match="Partial placement on mesh dimension 0.*redistribute"):
        scope_of(Fake(mesh, (Partial(), Replicate())), None, True, "p")

    # A destroyed process group: an error that says so (torch's lookup raised a bare
    # KeyError), at the step and at construction.
    group = dist.new_group(list(range(WORLD)))
    p = nn.Parameter(torch.randn(3))
    opt = ruda_torch.AdamW([p], fused_step=True, max_grad_norm=1.0, process_group=group)
    dist.destroy_process_group(group)
    p.grad = torch.randn(3)
    with pytest.raises(ValueError, match="process group .* is not a registered process group"):
        opt.step()
    assert torch.equal(p.grad, p.grad) and not opt.state
    with pytest.raises(ValueError, match="partition_group .* is not a registered process group"):
        ruda_torch.AdamW([p], partition_group=group)


def test_placements_by_meaning(tmp_path):
    run_scenario(tmp_path, "test_meshes:scenario_placement_meaning", world=WORLD)


def train_agreeing(layout, opt, what) -> None:
    """STEPS steps of ``layout`` with ``opt``: every rank's report the same bits after each."""
    for step in range(STEPS):
        layout.backward(step)
        opt.step()
        for other in world_gather(opt.last_report.tensor):
            assert same_bits(other, opt.last_report.tensor), (what, step)
        opt.zero_grad(set_to_none=True)


def check_8bit_layout(rank: int, workdir: str, layout_name: str) -> None:
    """8-bit moments on a mesh (Note [8-bit blocks on every mesh] in ruda_torch/_state8bit.py):
    every parameter's codes are a DTensor with its placements, its scales one per block of
    each row, sharded like it; every rank takes the same skip and clip decisions, and the
    model stays within the codes' error of the FP32 moments' run. The Rowwise layers'
    weights (rows of 14 cut into 7 + 7: not whole blocks) keep FP32 moments in a group of
    their own; 1-D parameters keep them anyway."""
    from ruda_torch import ops

    runs = {}
    for precision in ("8bit", "fp32"):
        layout = LAYOUTS[layout_name](rank)
        group = getattr(layout, "partition_group", None)
        cut = [
            p for p in layout.params() if any(pl.is_shard(1) for pl in getattr(p, "placements", ()))
        ]
        rest = [p for p in layout.params() if all(p is not q for q in cut)]
        groups = [{"params": rest}] + ([{"params": cut, "state_precision": "fp32"}] if cut else [])
        opt = ruda_torch.AdamW(groups, **HP, fused_step=True, hierarchical_stats=True,
                               max_grad_norm=MAX_GRAD_NORM, partition_group=group,
                               state_precision=precision, min_8bit_size=1)  # fmt: skip
        train_agreeing(layout, opt, precision)
        runs[precision] = (layout, opt)
    layout, opt = runs["8bit"]
    eight_bit = [p for p in opt.param_groups[0]["params"] if p.dim() >= 2]
    assert eight_bit
    for p in eight_bit:
        st = opt.state[p]
        codes, scales = st["exp_avg_codes"], st["exp_avg_scales"]
        assert "exp_avg" not in st and codes.dtype == torch.uint8
        assert codes.placements == p.placements and codes.shape == p.shape
        assert scales.placements == p.placements
        assert tuple(scales.shape) == ops.scales_shape_8bit(p.shape)
        assert tuple(_local(scales).shape) == ops.scales_shape_8bit(_local(codes).shape)
    full8, full32 = runs["8bit"][0].full_params(), runs["fp32"][0].full_params()
    for name, ref in full32.items():
        # 3 steps of lr 1e-2 from moments within 2^-5 of FP32's: well inside 2e-3.
        torch.testing.assert_close(full8[name], ref, rtol=0, atol=2e-3, msg=name)


@pytest.mark.parametrize("layout", ["tensor-parallel", "hsdp"])
def test_8bit_moments_on_four_ranks(tmp_path, layout):
    run_scenario(tmp_path, "test_meshes:check_8bit_layout", world=4, layout_name=layout)


def check_remainder_layout(rank: int, workdir: str, layout_name: str) -> None:
    """A BF16 model with remainder masters on a mesh (Note [Remainder master] in
    csrc/adamw_math.h): every remainder is a DTensor with its parameter's placements and
    local shape, every rank takes the same skip and clip decisions, and the FP32 masters
    are master_weights=True's on the same mesh (but for its even ties: a few in 10^4)."""
    from ruda_torch._remainder import master_from_remainder

    runs = {}
    for master in ("remainder", True):
        layout = LAYOUTS[layout_name](rank, dtype=torch.bfloat16)
        opt = ruda_torch.AdamW(layout.params(), **HP, fused_step=True, hierarchical_stats=True,
                               max_grad_norm=MAX_GRAD_NORM, master_weights=master)  # fmt: skip
        train_agreeing(layout, opt, master)
        runs[master] = (layout, opt)
    (layout, opt), (twin, twin_opt) = runs["remainder"], runs[True]
    for p, q in zip(layout.params(), twin.params(), strict=True):
        r = opt.state[p]["master_remainder"]
        assert r.dtype == torch.int16 and "master_param" not in opt.state[p]
        if hasattr(p, "placements"):
            assert r.placements == p.placements and r.shape == p.shape
        mine = master_from_remainder(_local(p), _local(r))
        theirs = _local(twin_opt.state[q]["master_param"])
        differ = int((mine.view(torch.int32) != theirs.view(torch.int32)).sum())
        assert differ <= max(2, mine.numel() // 10000), differ


@pytest.mark.parametrize("layout", ["tensor-parallel", "hsdp"])
def test_remainder_masters_on_four_ranks(tmp_path, layout):
    run_scenario(tmp_path, "test_meshes:check_remainder_layout", world=4, layout_name=layout)
