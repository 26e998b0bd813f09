"""ruda_torch.AdamW under FSDP1, FSDP2 (fully_shard), HSDP and DDP: 2 processes, gloo, CPU.

Every test starts two worker processes (one "scenario" each, doing several checks) and
bounds them with a timeout: a rank that hangs in a collective is killed and the test
fails. Workers are forked from the test process, which imports torch's lazily loaded
modules (torch._dynamo, which fully_shard pulls in, costs seconds per process) once
beforehand; where CUDA or a process group is already initialized in the test process
(which a forked child must not inherit), they come from a fork server that imports them
once instead. RUDA_TORCH_TEST_START_METHOD=fork|forkserver|spawn overrides the choice.

What is checked (docs/fsdp.md explains the design):
* the global gradient report: ``last_report.grad_norm`` on every rank equals a single
  process ``clip_grad_norm_`` of the unsharded model on the same global batch (1e-5
  relative), every rank's report has the same bits, and those bits are exactly the left
  fold, in rank order, of the ranks' local reports (or the local report itself where the
  gradients are replicated: DDP, HSDP's replicate dimension);
* training with ``max_grad_norm=1.0`` (which clips at every step here) follows a single
  process ``torch.optim.AdamW`` + ``clip_grad_norm_`` run (Note [Distributed tolerance]),
  with the statistics and with the tensor-operation norm (fused and generic paths);
* the optimizer state layout (DTensor state for FSDP2, ``step`` a plain 0-dim tensor);
* a non-finite gradient element on one rank skips the step on every rank;
* the errors: FSDP1 shards without ``process_group``, a ``process_group`` that is not
  the DTensor mesh's group;
* checkpoints: torch.distributed.checkpoint sharded (dcp.save/dcp.load) and full
  (broadcast from rank 0), and FSDP1's ``FSDP.optim_state_dict``: save mid-run, restore
  into a fresh model and optimizer, continue; the continued run is bit-identical to the
  uninterrupted one (reports, parameters, optimizer state);
* examples/fsdp_train.py (FSDP2, FSDP1): a resumed run ends with the same parameters.

Setups: "fsdp1" (FlatParameter shards), "fsdp1-orig-params" (use_orig_params=True),
"fsdp2" (fully_shard on a 1-D mesh), "hsdp" (fully_shard on a (replicate=2, shard=1)
mesh: placements (Replicate(), Shard(0))) and "ddp".
"""

from __future__ import annotations

import copy
import datetime
import io
import multiprocessing
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ruda_torch

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(),
        reason="torch.distributed with the gloo backend is not available",
    ),
]

WORLD = 2
# Seconds a scenario may take before its processes are killed (a normal run takes a few
# seconds once the parent has imported torch's lazy modules); the process group's own
# collective timeout is shorter, so a rank stuck in a collective errors out first.
SCENARIO_TIMEOUT_S = 180
COLLECTIVE_TIMEOUT_S = 90

IN_FEATURES, HIDDEN1, HIDDEN2, OUT_FEATURES = 7, 13, 5, 3
GLOBAL_BATCH = 8
LOCAL_BATCH = GLOBAL_BATCH // WORLD
STEPS = 6
SAVE_AFTER = 3  # checkpoints are taken after this many steps
MAX_GRAD_NORM = 1.0
# Explicit hyperparameters, the same on both sides (ruda_torch's defaults differ).
HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)

# Note [Distributed tolerance]
# The sharded run and the single-process reference do not see bit-identical gradients:
# FSDP averages the two ranks' half-batch gradients (reduce-scatter), the reference
# differentiates the mean over the whole batch, so each gradient element differs by a
# few FP32 ulps; and ruda_torch folds its norm in its own fixed order (statistics rows,
# then ranks), clip_grad_norm_ in torch's. The norms agree to about 1e-7 relative
# (measured: 8.4e-8 at worst over every setup and step; checked at 1e-5). Through Adam's
# normalized update (m / sqrt(v), 6 steps at lr=1e-2) those ulps move the parameters
# (magnitudes 1e-2..0.5) by at most 6e-8 absolute (measured over every setup). 1e-5
# relative plus 1e-6 absolute is a 15x margin and still fails any formula or clipping
# mistake: a step with the wrong clip coefficient moves parameters by up to lr = 1e-2,
# and a local instead of a global norm changes the norm itself by 15-60% here.
VS_SINGLE_PROCESS = dict(rtol=1e-5, atol=1e-6)
NORM_RTOL = 1e-5


# --------------------------------------------------------------------------- launching

# What every worker imports; fully_shard imports torch._dynamo lazily, which costs seconds
# per process.
_PRELOAD_MODULES = (
    "torch",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "ruda_torch",
)


def _start_method() -> str:
    """fork where the test process is still clean (no CUDA context, no process group, and
    autograd still usable in a forked child: a forked child must not inherit those), else
    a fork server that has imported the modules once, else spawn (every worker imports
    torch)."""
    chosen = os.environ.get("RUDA_TORCH_TEST_START_METHOD")
    if chosen:
        return chosen
    methods = multiprocessing.get_all_start_methods()
    if (
        "fork" in methods
        and not torch.cuda.is_initialized()
        and not dist.is_initialized()
        and _forked_autograd_works()
    ):
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"


_FORKED_AUTOGRAD_BROKEN = False


def _forked_autograd_works() -> bool:
    """Whether a child forked from this process can run a backward: not once this process
    has run one itself (torch's autograd engine then marks forked children, which raise
    "Unable to handle autograd's threading in combination with fork-based
    multiprocessing"), as an earlier test in the same pytest worker may have. Asked of a
    forked child itself, not guessed; once broken it stays broken, and is not asked
    again."""
    global _FORKED_AUTOGRAD_BROKEN
    if _FORKED_AUTOGRAD_BROKEN:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # the child: a backward, then the verdict as the exit status
        try:
            torch.ones(1, requires_grad=True).sum().backward()
            code = 0
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    _FORKED_AUTOGRAD_BROKEN = os.waitstatus_to_exitcode(status) != 0
    return not _FORKED_AUTOGRAD_BROKEN


def _preload(method: str) -> None:
    """Import the workers' modules where they will be forked from."""
    import importlib

    if method == "fork":
        for name in _PRELOAD_MODULES:
            importlib.import_module(name)
    elif method == "forkserver":
        # Takes effect when the fork server starts (first use in this process).
        multiprocessing.set_forkserver_preload([*_PRELOAD_MODULES, __name__])


def _worker(rank: int, scenario: str, store: str, workdir: str, kwargs: dict, world: int) -> None:
    torch.set_num_threads(1)  # two ranks on two cores; also keeps fork + OpenMP safe
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        _scenario(scenario)(rank, workdir, **kwargs)
        dist.barrier()
    except Exception:
        raise
    except BaseException as e:  # pytest.fail, "DID NOT RAISE": reported like any error
        raise AssertionError(f"{type(e).__name__}: {e}") from e
    finally:
        dist.destroy_process_group()


def _scenario(name: str):
    """A scenario of this file by name, or of another test module as "module:function"
    (tests/test_meshes.py shares this launcher)."""
    if ":" not in name:
        return SCENARIOS[name]
    import importlib

    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


def run_scenario(tmp_path, scenario: str, world: int = WORLD, **kwargs) -> None:
    """Run the scenario (``_scenario``) as ``(rank, workdir, **kwargs)`` on ``world`` ranks; a worker's
    exception fails the test with its traceback, a run past the timeout kills them."""
    import torch.multiprocessing as mp

    method = _start_method()
    _preload(method)
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork() in a process with threads; the workers only use
        # the CPU, with one intra-op thread.
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx = mp.start_processes(
            _worker,
            args=(scenario, str(tmp_path / "store"), str(tmp_path), kwargs, world),
            nprocs=world,
            join=False,
            start_method=method,
        )
    deadline = time.monotonic() + SCENARIO_TIMEOUT_S
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(
                    f"distributed scenario {scenario!r} ({method}) did not finish within "
                    f"{SCENARIO_TIMEOUT_S} s; its processes were killed"
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(10)


# --------------------------------------------------------------------------- model and data


def make_model() -> nn.Sequential:
    """Odd sizes: FSDP1 pads its flat parameters, FSDP2 shards dim 0 unevenly (13 rows ->
    7 + 6, 3 rows -> 2 + 1), and with use_orig_params=True some parameters have no
    elements (and no gradient) on one rank."""
    torch.manual_seed(1234)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN1),
        nn.Tanh(),
        nn.Linear(HIDDEN1, HIDDEN2),
        nn.Tanh(),
        nn.Linear(HIDDEN2, OUT_FEATURES),
    )


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=gen)
    # Large targets: the gradient norm stays well above MAX_GRAD_NORM, so every step clips.
    y = 4.0 * torch.randn(GLOBAL_BATCH, OUT_FEATURES, generator=gen)
    return x, y


def local_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    return x[rows], y[rows]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def reference_run(steps: int, make=None, batch=None, loss=None, max_norm=MAX_GRAD_NORM):
    """Single process, unsharded: torch.optim.AdamW + clip_grad_norm_ on the global batch.
    Returns the norms clip_grad_norm_ reported and the final parameters by name. The model,
    batches, loss and clip norm default to this file's (tests/test_meshes.py passes its
    own)."""
    make, batch, loss = make or make_model, batch or global_batch, loss or loss_fn
    model = make()
    opt = torch.optim.AdamW(model.parameters(), **HP, foreach=False)
    norms = []
    for step in range(steps):
        x, y = batch(step)
        loss(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- setups

SETUPS = ("fsdp1", "fsdp1-orig-params", "fsdp2", "hsdp", "ddp")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _clean_name(name: str) -> str:
    for prefix in ("_fsdp_wrapped_module.", "module."):
        name = name.replace(prefix, "")
    return name


def build(setup: str, *, process_group="default", dtype=None, **opt_kwargs):
    """A fresh sharded model (its parameters in ``dtype`` when given) and its
    ruda_torch.AdamW. ``process_group="default"`` passes what the setup needs: the FSDP
    group for FSDP1, nothing otherwise."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    if dtype is not None:
        model = model.to(dtype)
    if setup.startswith("fsdp1"):
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(
            model,
            device_id=torch.device("cpu"),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            use_orig_params=setup == "fsdp1-orig-params",
        )
        default_group = dist.group.WORLD
    elif setup in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh

        if setup == "fsdp2":
            mesh = init_device_mesh("cpu", (WORLD,))
        else:  # replicate over both ranks, shard over one: placements (Replicate, Shard(0))
            mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        default_group = None
    elif setup == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        default_group = None
    else:
        raise AssertionError(setup)
    if process_group == "default":
        process_group = default_group
    kwargs = dict(HP, fused_step=True, hierarchical_stats=True, max_grad_norm=MAX_GRAD_NORM)
    kwargs.update(opt_kwargs)
    opt = ruda_torch.AdamW(model.parameters(), **kwargs, process_group=process_group)
    return model, opt


def full_params(setup: str, model) -> dict[str, torch.Tensor]:
    """The unsharded parameters by their single-process names (a collective)."""
    if setup.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False):
            return {_clean_name(n): p.detach().clone() for n, p in model.named_parameters()}
    if setup in ("fsdp2", "hsdp"):
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {_clean_name(n): p.detach().clone() for n, p in model.named_parameters()}


def backward(model, step: int, rank: int) -> None:
    x, y = local_batch(step, rank)
    dtype = next(model.parameters()).dtype  # a BF16 model takes BF16 inputs
    loss_fn(model(x.to(dtype)).float(), y).backward()


def train(model, opt, steps, rank: int) -> list[torch.Tensor]:
    """Step through ``steps``; returns a copy of every step's report tensor."""
    reports = []
    for step in steps:
        backward(model, step, rank)
        opt.step()
        reports.append(opt.last_report.tensor.clone())
        opt.zero_grad(set_to_none=True)
    return reports


def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t)
    return out


_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
         torch.int16: torch.int16, torch.uint8: torch.uint8}  # fmt: skip


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (NaNs included, -0.0 != 0.0) of two FP32 (or 16-bit) tensors."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = _BITS[a.dtype]
    return torch.equal(a.reshape(-1).view(bits), b.reshape(-1).view(bits))


def local_params(model) -> list[torch.Tensor]:
    return [_local(p).detach().clone() for p in model.parameters()]


def local_state(model, opt) -> list[dict[str, torch.Tensor]]:
    return [
        {k: _local(v).clone() for k, v in opt.state[p].items()} if p in opt.state else {}
        for p in model.parameters()
    ]


def assert_same_bits(actual: list, expected: list, what: str) -> None:
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if isinstance(a, dict):
            assert a.keys() == e.keys(), f"{what} [{i}]: keys {sorted(a)} != {sorted(e)}"
            for k in a:
                assert same_bits(a[k], e[k]), f"{what} [{i}][{k!r}] differs"
        else:
            assert same_bits(a, e), f"{what} [{i}] differs: {a} vs {e}"


class LocalReports:
    """The report this rank alone would compute: a second, local-only optimizer over
    copies of this rank's parameter shards (same order, hence the same bucket layout)
    whose gradients are this rank's gradient shards, stepped with lr=0."""

    def __init__(self, model):
        self.model = model
        self.copies = [_local(p).detach().clone() for p in model.parameters()]
        self.opt = ruda_torch.AdamW(
            self.copies, **dict(HP, lr=0.0), fused_step=True, hierarchical_stats=True
        )

    def report(self) -> torch.Tensor:
        for c, p in zip(self.copies, self.model.parameters(), strict=True):
            c.grad = None if p.grad is None else _local(p.grad).detach().clone()
        self.opt.step()
        return self.opt.last_report.tensor.clone()


def fold_in_rank_order(reports: list[torch.Tensor]) -> torch.Tensor:
    out = torch.empty(3, dtype=torch.float32)
    ruda_torch.ops.merge_gradient_stats_chunks(torch.stack(reports), out)
    return out


# --------------------------------------------------------------------------- scenarios


def scenario_training(rank: int, workdir: str, setup: str) -> None:
    """Global report against clip_grad_norm_, bit-identical across ranks and equal to
    the rank-order fold of the local reports; the trajectory against torch.optim.AdamW;
    state layout; a non-finite element on one rank skips every rank."""
    ref_norms, ref_params = reference_run(STEPS)
    model, opt = build(setup)
    local = LocalReports(model)
    sharded = setup not in ("ddp", "hsdp")  # hsdp: its shard dimension has one rank
    for step in range(STEPS):
        backward(model, step, rank)
        mine = local.report()
        opt.step()
        report = opt.last_report
        # 1. The global norm is the single-process norm of the same global batch.
        norm = report.grad_norm.item()
        assert norm == pytest.approx(ref_norms[step], rel=NORM_RTOL), (step, norm, ref_norms)
        assert ref_norms[step] > 2 * MAX_GRAD_NORM  # the test really clips
        assert report.clip_coef.item() == pytest.approx(MAX_GRAD_NORM / (norm + 1e-6))
        assert report.nonfinite_count.item() == 0 and not report.skipped.item()
        # 2. Every rank has the same bits, and they are the fold of the local reports in
        # rank order (or the local report itself where gradients are replicated).
        everyone = all_gather(report.tensor)
        for r, other in enumerate(everyone):
            assert same_bits(other, report.tensor), (step, r, other, report.tensor)
        gathered_local = all_gather(mine)
        expected = fold_in_rank_order(gathered_local) if sharded else mine
        assert same_bits(report.tensor, expected), (step, report.tensor, gathered_local)
        if sharded:  # really a cross-rank sum: no rank alone has the global report
            assert all(not same_bits(r, report.tensor) for r in gathered_local)
        opt.zero_grad(set_to_none=True)

    # 3. The trajectory: several clipped steps against torch.optim.AdamW + clip_grad_norm_.
    params = full_params(setup, model)
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, **VS_SINGLE_PROCESS, msg=name)

    # 4. State layout: views of the local shard; DTensors with the parameter's mesh and
    # placements for FSDP2; ``step`` a plain 0-dim FP32 tensor.
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        st = opt.state.get(p)
        if p.grad is None and not st:
            assert setup == "fsdp1-orig-params" and _local(p).numel() == 0
            continue
        assert sorted(st) == ["exp_avg", "exp_avg_sq", "step"]
        step_t = st["step"]
        assert type(step_t) is torch.Tensor and step_t.dtype == torch.float32
        assert step_t.dim() == 0 and step_t.item() == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            v = st[key]
            if isinstance(p, DTensor):
                assert isinstance(v, DTensor), key
                assert v.device_mesh == p.device_mesh and v.placements == p.placements
                assert v.shape == p.shape and v.to_local().shape == p.to_local().shape
            else:
                assert type(v) is torch.Tensor and v.shape == p.shape, key

    # 5. A non-finite gradient on one rank: every rank skips, nothing changes. Sharded:
    # one element of rank 1's gradient shard, after the reduction, so that only the global
    # report can tell rank 0. Replicated (DDP, HSDP): an inf in rank 1's input, which the
    # gradient all-reduce spreads to every rank's copy.
    if sharded:
        backward(model, STEPS, rank)
        if rank == 1:
            g = next(
                _local(p.grad)
                for p in model.parameters()
                if p.grad is not None and _local(p.grad).numel() > 0
            )
            g.view(-1)[0] = float("inf")
    else:
        x, y = local_batch(STEPS, rank)
        if rank == 1:
            x[0, 0] = float("inf")
        loss_fn(model(x), y).backward()
    before_p, before_s = local_params(model), local_state(model, opt)
    opt.step()
    report = opt.last_report
    if sharded:
        assert report.nonfinite_count.item() == 1
    else:
        assert report.nonfinite_count.item() > 0
    assert report.skipped.item()
    assert_same_bits(local_params(model), before_p, "parameters after a skipped step")
    assert_same_bits(local_state(model, opt), before_s, "state after a skipped step")
    opt.zero_grad(set_to_none=True)


def scenario_clipping_without_statistics(rank: int, workdir: str, setup: str) -> None:
    """max_grad_norm without hierarchical_stats (a tensor-operation norm, all-reduced over
    the same scopes), on the fused and on the generic path: the same trajectory as
    torch.optim.AdamW + clip_grad_norm_ on one process."""
    _, ref_params = reference_run(STEPS)
    for fused_step in (True, False):
        model, opt = build(setup, hierarchical_stats=False, fused_step=fused_step)
        for step in range(STEPS):
            backward(model, step, rank)
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert opt.last_report is None
        params = full_params(setup, model)
        for name, ref in ref_params.items():
            torch.testing.assert_close(
                params[name], ref, **VS_SINGLE_PROCESS, msg=f"fused_step={fused_step} {name}"
            )


FSDP1_ERROR_CASES = {
    # fused path: the statistics, clipping from the statistics, tensor-op clipping
    "fused": (
        dict(fused_step=True, hierarchical_stats=True),
        dict(fused_step=True, hierarchical_stats=True, max_grad_norm=MAX_GRAD_NORM),
        dict(fused_step=True, max_grad_norm=MAX_GRAD_NORM),
    ),
    # generic path: tensor-op clipping
    "generic": (dict(fused_step=False, max_grad_norm=MAX_GRAD_NORM),),
}


def scenario_errors_fsdp1(rank: int, workdir: str, setup: str, path: str) -> None:
    """FSDP1 shards without process_group: a ValueError that says to pass it, raised
    before anything is written (parameters and optimizer state as before the step).
    Without statistics and clipping the update is per element and needs no group."""
    for kwargs in FSDP1_ERROR_CASES[path]:
        model, _ = build(setup)
        before = local_params(model)
        opt = None
        with pytest.raises(ValueError, match="process_group"):
            opt = ruda_torch.AdamW(model.parameters(), **HP, **kwargs)
            backward(model, 0, rank)
            opt.step()
        assert_same_bits(local_params(model), before, f"parameters after the error {kwargs}")
        if opt is not None:
            created = list(opt.state.values())[:1]
            assert not opt.state, f"{kwargs}: the failed step created state {created}"
    model, _ = build(setup)
    opt = ruda_torch.AdamW(model.parameters(), **HP, fused_step=path == "fused")
    backward(model, 0, rank)
    opt.step()  # no statistics, no clipping: accepted without a group


def scenario_errors_fsdp2(rank: int, workdir: str) -> None:
    """FSDP2: a process_group other than the mesh's is a ValueError; the mesh's own group
    is accepted and gives the same bits as process_group=None."""
    singletons = [dist.new_group([r]) for r in range(WORLD)]  # collective: every rank
    model, _ = build("fsdp2")
    opt = ruda_torch.AdamW(
        model.parameters(),
        **HP,
        fused_step=True,
        hierarchical_stats=True,
        max_grad_norm=MAX_GRAD_NORM,
        process_group=singletons[rank],
    )
    backward(model, 0, rank)
    before = local_params(model)
    with pytest.raises(ValueError, match="process_group"):
        opt.step()
    assert_same_bits(local_params(model), before, "parameters after the error")

    reports = {}
    for name, group in (("none", None), ("world", dist.group.WORLD)):
        model, opt = build("fsdp2", process_group=group)
        reports[name] = train(model, opt, range(2), rank)
    assert_same_bits(reports["world"], reports["none"], "reports with process_group=WORLD")


# Note [FSDP1 full optim state dict on CPU]
# torch's FSDP1 with use_orig_params=True returns a wrong *full* optimizer state dict when
# the compute device is the CPU and the state is offloaded to the CPU (the default of
# FSDP.optim_state_dict, and cpu_offload=True of get_optimizer_state_dict): every state of
# a parameter holds the values of its last state (here exp_avg == exp_avg_sq), for
# torch.optim.AdamW exactly as for ruda_torch.AdamW. torch gathers each state into one
# reused buffer and keeps views of it; ``.cpu()`` of a CPU tensor is a no-op that copies
# nothing (torch/distributed/fsdp/_optim_utils.py, _allgather_orig_param_states and
# _unflatten_orig_param_states). Without the offload the views are cloned, so that setup
# saves with offload_to_cpu=False / cpu_offload=False. On GPUs the offload copies and is
# not affected.


# Note [FSDP1 full model state dict with CPU offload on torch 2.13]
# On torch 2.11.0, 2.12.1 and 2.13.0 (measured with torch.optim.AdamW alone; 2.14.1 is
# fixed; 2.10 and older not measured) get_model_state_dict(full_state_dict=True,
# cpu_offload=True) of an FSDP1 model (use_orig_params=False) on the CPU raises inside
# torch, for torch.optim.AdamW as for ruda_torch.AdamW: "setStorage: sizes [91] ... out of
# bounds for storage of size 0" from FlatParamHandle._get_unflat_views while unsharding
# (torch/distributed/fsdp/_flat_param.py; pytorch/pytorch#188989: the to_cpu context frees
# the unsharded flat parameter although it already is on the CPU). Without the offload
# it works; docs/fsdp.md.
_TORCH_2_14 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)


def _offload_ok(setup: str) -> bool:
    if setup == "fsdp1" and not _TORCH_2_14:
        return False  # Note [FSDP1 full model state dict with CPU offload on torch 2.13]
    return setup != "fsdp1-orig-params"


def _save(flow: str, setup: str, model, opt, path: str, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if flow == "dcp-sharded":
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(sd, checkpoint_id=path)
    elif flow == "dcp-full":
        offload = _offload_ok(setup)
        options = StateDictOptions(full_state_dict=True, cpu_offload=offload)
        sd = {
            "model": get_model_state_dict(model, options=options),
            "optim": get_optimizer_state_dict(model, opt, options=options),
        }
        if rank == 0:
            torch.save(sd, path)
        elif offload:  # with cpu_offload only rank 0 receives the full state dict
            assert not sd["model"] and not sd["optim"].get("state")
    elif flow == "fsdp1-optim-state-dict":
        from torch.distributed.fsdp import FullOptimStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=_offload_ok(setup)),
        ):
            sd = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
        torch.save(sd, f"{path}.rank{rank}")
    else:
        raise AssertionError(flow)
    dist.barrier()


def _restore(flow: str, setup: str, model, opt, path: str, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if flow == "dcp-sharded":
        # get_optimizer_state_dict materializes the fresh optimizer's state (a step with
        # zero gradients and lr=0) so that dcp.load has tensors to load into.
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
    elif flow == "dcp-full":
        sd = torch.load(path, weights_only=False) if rank == 0 else {"model": {}, "optim": {}}
        set_model_state_dict(
            model,
            sd["model"],
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        set_optimizer_state_dict(
            model,
            opt,
            sd["optim"],
            options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True
            ),
        )
    elif flow == "fsdp1-optim-state-dict":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        sd = torch.load(f"{path}.rank{rank}", weights_only=False)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            model.load_state_dict(sd["model"])
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, sd["optim"]))
    else:
        raise AssertionError(flow)


def resume_bit_for_bit(flow: str, setup: str, model, opt, path: str, rank: int, **build_kw):
    """Save ``model``/``opt`` (after SAVE_AFTER steps) by ``flow``, train on to STEPS; restore
    into a fresh ``build(setup, **build_kw)`` and train the same steps: the restored and the
    final parameters, state and reports bit-identical. Returns the fresh pair and the
    final parameters and state."""
    saved_params, saved_state = local_params(model), local_state(model, opt)
    _save(flow, setup, model, opt, path, rank)
    expected = train(model, opt, range(SAVE_AFTER, STEPS), rank)
    expected_params, expected_state = local_params(model), local_state(model, opt)
    fresh, fresh_opt = build(setup, **build_kw)
    _restore(flow, setup, fresh, fresh_opt, path, rank)
    assert_same_bits(local_state(fresh, fresh_opt), saved_state, f"{flow}: restored state")
    assert_same_bits(local_params(fresh), saved_params, f"{flow}: restored parameters")
    reports = train(fresh, fresh_opt, range(SAVE_AFTER, STEPS), rank)
    assert_same_bits(reports, expected, f"{flow}: reports after resuming")
    assert_same_bits(local_params(fresh), expected_params, f"{flow}: final parameters")
    assert_same_bits(local_state(fresh, fresh_opt), expected_state, f"{flow}: final state")
    return fresh, fresh_opt, expected_params, expected_state


def scenario_checkpoint(rank: int, workdir: str, setup: str, flows: tuple[str, ...]) -> None:
    """Save after SAVE_AFTER steps (every flow), finish the run; then per flow: a fresh
    model and optimizer, restore, run the remaining steps; everything bit-identical."""
    paths = {flow: os.path.join(workdir, f"ckpt-{flow}") for flow in flows}
    model, opt = build(setup)
    train(model, opt, range(SAVE_AFTER), rank)
    saved_params, saved_state = local_params(model), local_state(model, opt)
    for flow in flows:
        _save(flow, setup, model, opt, paths[flow], rank)
    # Saving changes nothing.
    assert_same_bits(local_params(model), saved_params, "parameters after saving")
    assert_same_bits(local_state(model, opt), saved_state, "state after saving")
    expected_reports = train(model, opt, range(SAVE_AFTER, STEPS), rank)
    expected_params, expected_state = local_params(model), local_state(model, opt)

    for flow in flows:
        fresh, fresh_opt = build(setup)
        _restore(flow, setup, fresh, fresh_opt, paths[flow], rank)
        assert_same_bits(local_params(fresh), saved_params, f"{flow}: restored parameters")
        assert_same_bits(local_state(fresh, fresh_opt), saved_state, f"{flow}: restored state")
        reports = train(fresh, fresh_opt, range(SAVE_AFTER, STEPS), rank)
        assert_same_bits(reports, expected_reports, f"{flow}: reports after resuming")
        assert_same_bits(local_params(fresh), expected_params, f"{flow}: final parameters")
        assert_same_bits(local_state(fresh, fresh_opt), expected_state, f"{flow}: final state")


def scenario_example(rank: int, workdir: str, flags: list[str]) -> None:
    """examples/fsdp_train.py (tiny sizes) in this process group: a run that saves a DCP
    checkpoint mid-way, then a fresh one that resumes from it, end with the same
    parameter checksum; only rank 0 prints."""
    import contextlib
    import importlib.util
    import io
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "fsdp_train.py"
    spec = importlib.util.spec_from_file_location("fsdp_train_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    argv = [*flags, "--device", "cpu", "--steps", "6", "--log-every", "2", "--batch", "4"]
    argv += ["--seq-len", "8", "--vocab", "16", "--d-model", "16", "--heads", "2"]
    argv += ["--ckpt-dir", os.path.join(workdir, "ckpt")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        uninterrupted = example.main([*argv, "--save-at", "3"])
        resumed = example.main([*argv, "--resume"])
    text = out.getvalue()
    assert resumed == uninterrupted, (resumed, uninterrupted, text)
    if rank == 0:
        for expected in ("grad norm", "saved checkpoint", "resumed from", "at step 3"):
            assert expected in text, (expected, text)
    else:
        assert text == "", text


def zero_resume(rank: int, optimizer_class, **extra):
    """ZeroRedundancyOptimizer around ``optimizer_class``: SAVE_AFTER steps, a
    consolidated checkpoint, the steps after it; then the checkpoint loaded into the
    optimizer that went past it and the same steps again. Returns (parameters of the
    uninterrupted run, of the resumed run, the ZeRO optimizer). Every rank sees the global
    batch (replicated gradients, no DDP)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = make_model()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=optimizer_class, **HP, **extra
    )

    def train(steps):
        for step in steps:
            opt.zero_grad(set_to_none=True)
            x, y = global_batch(step)
            loss_fn(model(x), y).backward()
            opt.step()

    train(range(SAVE_AFTER))
    opt.consolidate_state_dict(to=0)
    box = [copy.deepcopy(opt.state_dict()) if rank == 0 else None]  # not live tensors
    dist.broadcast_object_list(box, src=0)
    params = [p.detach().clone() for p in model.parameters()]
    train(range(SAVE_AFTER, STEPS))  # past the checkpoint
    straight = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, saved in zip(model.parameters(), params, strict=True):
            p.copy_(saved)
    opt.load_state_dict(box[0])
    train(range(SAVE_AFTER, STEPS))  # again, from the loaded checkpoint
    return straight, [p.detach().clone() for p in model.parameters()], opt


def scenario_zero_load_after_steps(rank: int, workdir: str, fused: bool) -> None:
    """ZeroRedundancyOptimizer around ruda_torch.AdamW: its load_state_dict assigns
    ``optim.state[param] = ...`` into the local optimizer (and moves 0-dim tensors to the
    CPU). Load a checkpoint taken after SAVE_AFTER steps into an optimizer that has
    stepped past it, then continue: bit-identical to the run that never went past the
    checkpoint, and within Note [Optimizer-level tolerance] of torch.optim.AdamW doing
    the same (zero_resume)."""
    # deepcopy shares the process group (a handle to communicators), and keeps it.
    grouped = ruda_torch.AdamW(make_model().parameters(), process_group=dist.group.WORLD)
    assert copy.deepcopy(grouped).process_group is dist.group.WORLD
    ours_straight, ours_resumed, _ = zero_resume(rank, ruda_torch.AdamW, fused_step=fused)
    torch_straight, torch_resumed, _ = zero_resume(rank, torch.optim.AdamW, foreach=False)
    assert_same_bits(ours_resumed, ours_straight, "ZeRO: resumed vs uninterrupted")
    assert_same_bits(torch_resumed, torch_straight, "torch ZeRO: resumed vs uninterrupted")
    for a, b in zip(ours_resumed, torch_resumed, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


def scenario_zero_global_statistics(rank: int, workdir: str) -> None:
    """ZeroRedundancyOptimizer with hierarchical_stats and max_grad_norm: given
    partition_group, every rank's report is the one over all ranks' partitions (each
    rank's partition report folded in rank order), the clip uses the global norm, and a
    NaN in one rank's partition skips the step on every rank."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    # partition_group sums whole reports: overlapping the group that already sums the
    # shards would count a part twice.
    with pytest.raises(ValueError, match=r"partition_group \(ranks \[0, 1\]\) shares ranks"):
        ruda_torch.AdamW(make_model().parameters(), process_group=dist.group.WORLD,
                         partition_group=dist.group.WORLD)  # fmt: skip
    # The same check when it is set between steps (docs/usage.md), before anything changes.
    overlapping = ruda_torch.AdamW(make_model().parameters(), process_group=dist.group.WORLD)
    with pytest.raises(ValueError, match=r"partition_group \(ranks \[0, 1\]\) shares ranks"):
        overlapping.partition_group = dist.group.WORLD
    assert overlapping.partition_group is None
    with pytest.raises(TypeError, match="partition_group must be a torch.distributed.Process"):
        overlapping.partition_group = "world"
    model = make_model()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=ruda_torch.AdamW, **HP, fused_step=True,
        hierarchical_stats=True, max_grad_norm=MAX_GRAD_NORM,
    )  # fmt: skip
    local = opt.optim
    local.partition_group = dist.group.WORLD  # as if given at construction
    x, y = global_batch(0)
    loss_fn(model(x), y).backward()
    mine = [p for g in local.param_groups for p in g["params"]]
    assert mine and len(mine) < len(list(model.parameters())), "each rank holds a part"
    every = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    report = local.last_report.tensor
    norm = report[0].sqrt().item()
    torch.testing.assert_close(norm, every.double().norm().item(), rtol=1e-6, atol=0)
    gathered = all_gather(report)
    assert all(same_bits(r, gathered[0]) for r in gathered), "ranks disagree on the report"
    assert local.last_report.clip_coef.item() < 1.0 or norm <= MAX_GRAD_NORM
    moved = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)]
    assert all(moved), "a finite global step updates every partition"
    # A NaN in rank 1's partition only: no rank steps.
    opt.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    if rank == 1:
        mine[0].grad.view(-1)[0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert local.last_report.tensor[2].item() == 1.0, "the non-finite count is global"
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b), "a rank stepped although another rank's gradient was NaN"


# Note [Rank order needs three ranks]: with two reports a fold in rank order and one in
# reverse order add the same two numbers (IEEE addition is commutative), so only three or
# more ranks can show the order. Local sums of squares 1, 2^-24, 2^-24 fold in rank order
# to (1 + 2^-24) + 2^-24 = 1 (each addition a tie, rounded to even) and in any order that
# adds the two small ones first to 1 + 2^-23; with the large one last, the other way round.
RANK_ORDER_GRADS = {
    "large-first": (1.0, 2.0**-12, 2.0**-12),
    "large-last": (2.0**-12, 2.0**-12, 1.0),
}


def scenario_rank_order(rank: int, workdir: str, layout: str) -> None:
    grads = RANK_ORDER_GRADS[layout]
    p = nn.Parameter(torch.zeros(1))
    p.grad = torch.tensor([grads[rank]])
    opt = ruda_torch.AdamW([p], fused_step=True, hierarchical_stats=True,
                           process_group=dist.group.WORLD)  # fmt: skip
    opt.step()
    squares = [torch.tensor(g * g, dtype=torch.float32) for g in grads]
    in_rank_order = (squares[0] + squares[1]) + squares[2]
    reversed_order = (squares[2] + squares[1]) + squares[0]
    assert in_rank_order.item() != reversed_order.item(), "the case must tell the orders apart"
    got = opt.last_report.tensor[0]
    assert got.item() == in_rank_order.item(), (
        f"rank {rank}: global sum of squares {got.item()!r}, rank order gives "
        f"{in_rank_order.item()!r}, reverse order {reversed_order.item()!r}"
    )


def scenario_flat_grads(rank: int, workdir: str, bucket_view: bool) -> None:
    """flat_grads=True under DDP: DDP writes the averaged gradients into the views in
    place (its default), so every step is the flat path's and the trajectory and reports
    are those of flat_grads=False bit for bit. With gradient_as_bucket_view=True DDP
    replaces the views with its own buckets at every backward: still the same bits, each
    step copying them back, and a warning that says so. FSDP1 and FSDP2 parameters are
    refused with what to do."""
    import warnings

    runs = {}
    for flat in (False, True):
        model = nn.parallel.DistributedDataParallel(
            make_model(), gradient_as_bucket_view=bucket_view
        )
        kwargs = dict(HP, fused_step=True, hierarchical_stats=True, max_grad_norm=MAX_GRAD_NORM)
        opt = ruda_torch.AdamW(model.parameters(), **kwargs, flat_grads=flat)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reports = train(model, opt, range(1, 6), rank)
        flat_path = flat and all(
            p.grad is v
            for b in opt._plan.buckets
            for p, v in zip(b.params, b.grad_views, strict=True)
        )
        runs[flat] = (local_params(model), local_state(model, opt), reports, caught, flat_path)
    assert_same_bits(runs[True][0], runs[False][0], "parameters")
    assert_same_bits(runs[True][2], runs[False][2], "reports")
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        assert_same_bits(list(a.values()), list(b.values()), "state")
    assert runs[True][4], "after the step every gradient is a view of the flat buffer again"
    replaced = [w for w in runs[True][3] if "flat_grads=True" in str(w.message)]
    assert bool(replaced) == bucket_view, [str(w.message) for w in runs[True][3]]
    if bucket_view:
        assert "gradient_as_bucket_view=True" in str(replaced[0].message)
    for setup, match in (("fsdp1", "FlatParameter"), ("fsdp2", "DTensor")):
        with pytest.raises(ValueError, match=match):
            build(setup, flat_grads=True)


def scenario_pickling_process_groups(rank: int, workdir: str) -> None:
    """An optimizer with process_group or partition_group: pickle and torch.save(optimizer)
    refuse it with an error that names the option and says what to use (state_dict), and
    change nothing; deepcopy shares the group and steps as the original; the state dict
    (rank tuples in place of the groups) loads into an optimizer made with the group and
    resumes it bit for bit."""
    import pickle

    for name in ("process_group", "partition_group"):
        model = make_model()
        opt = ruda_torch.AdamW(model.parameters(), **HP, fused_step=True,
                               max_grad_norm=MAX_GRAD_NORM, hierarchical_stats=True,
                               **{name: dist.group.WORLD})  # fmt: skip
        train(model, opt, range(1, 3), rank)
        before = local_state(model, opt)
        for save in (pickle.dumps, lambda o: torch.save(o, io.BytesIO())):
            with pytest.raises(TypeError, match=rf"{name}= \(ranks \[0, 1\]\) cannot be "
                               r"pickled.*optimizer\.state_dict\(\)"):  # fmt: skip
                save(opt)
        after = local_state(model, opt)
        for a, b in zip(before, after, strict=True):
            assert_same_bits(list(a.values()), list(b.values()), "state after a refused pickle")
        twin_model, twin = copy.deepcopy((model, opt))  # one memo: the copy's parameters
        assert getattr(twin, name) is dist.group.WORLD
        resumed_model = copy.deepcopy(model)
        resumed = ruda_torch.AdamW(resumed_model.parameters(), **HP, fused_step=True,
                                   max_grad_norm=MAX_GRAD_NORM, hierarchical_stats=True,
                                   **{name: dist.group.WORLD})  # fmt: skip
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        resumed.load_state_dict(torch.load(buf, weights_only=True))
        reports = [train(m, o, range(3, 5), rank)
                   for m, o in ((model, opt), (twin_model, twin), (resumed_model, resumed))]  # fmt: skip
        for m in (twin_model, resumed_model):
            assert_same_bits(local_params(m), local_params(model), f"{name}: parameters")
        assert_same_bits(reports[1], reports[0], f"{name}: deepcopy reports")
        assert_same_bits(reports[2], reports[0], f"{name}: resumed reports")


SCENARIOS = {
    "pickling-process-groups": scenario_pickling_process_groups,
    "flat-grads": scenario_flat_grads,
    "rank-order": scenario_rank_order,
    "zero-global-statistics": scenario_zero_global_statistics,
    "zero-load-after-steps": scenario_zero_load_after_steps,
    "training": scenario_training,
    "clipping-without-statistics": scenario_clipping_without_statistics,
    "errors-fsdp1": scenario_errors_fsdp1,
    "errors-fsdp2": scenario_errors_fsdp2,
    "checkpoint": scenario_checkpoint,
    "example": scenario_example,
}

# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("bucket_view", [False, True], ids=["ddp", "ddp-bucket-view"])
def test_flat_grads_under_ddp(tmp_path, bucket_view):
    run_scenario(tmp_path, "flat-grads", bucket_view=bucket_view)


@pytest.mark.parametrize("setup", SETUPS)
def test_training_global_report_and_trajectory(tmp_path, setup):
    run_scenario(tmp_path, "training", setup=setup)


@pytest.mark.parametrize("setup", SETUPS)
def test_clipping_without_statistics(tmp_path, setup):
    run_scenario(tmp_path, "clipping-without-statistics", setup=setup)


@pytest.mark.parametrize("path", list(FSDP1_ERROR_CASES))
@pytest.mark.parametrize("setup", ["fsdp1", "fsdp1-orig-params"])
def test_fsdp1_without_process_group_is_an_error(tmp_path, setup, path):
    run_scenario(tmp_path, "errors-fsdp1", setup=setup, path=path)


def test_fsdp2_process_group_must_match_the_mesh(tmp_path):
    run_scenario(tmp_path, "errors-fsdp2")


CHECKPOINT_FLOWS = {
    "fsdp1": ("fsdp1-optim-state-dict", "dcp-sharded", "dcp-full"),
    "fsdp1-orig-params": ("fsdp1-optim-state-dict", "dcp-sharded", "dcp-full"),
    "fsdp2": ("dcp-sharded", "dcp-full"),
}


@pytest.mark.parametrize("setup", list(CHECKPOINT_FLOWS))
def test_checkpoint_resume_is_bit_identical(tmp_path, setup):
    run_scenario(tmp_path, "checkpoint", setup=setup, flows=CHECKPOINT_FLOWS[setup])


@pytest.mark.parametrize(
    "flags",
    [[], ["--fsdp1"], ["--fsdp1", "--use-orig-params"],
     ["--state-precision", "8bit", "--min-8bit-size", "64"],
     ["--fsdp1", "--state-precision", "8bit", "--min-8bit-size", "64"]],
    ids=["fsdp2", "fsdp1", "fsdp1-orig-params", "fsdp2-8bit", "fsdp1-8bit"],
)  # fmt: skip
def test_example_fsdp_train_resumes_bit_identically(tmp_path, flags):
    run_scenario(tmp_path, "example", flags=flags)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "generic"])
def test_zero_redundancy_optimizer_load_into_a_stepped_optimizer(tmp_path, fused):
    run_scenario(tmp_path, "zero-load-after-steps", fused=fused)


@pytest.mark.parametrize("layout", list(RANK_ORDER_GRADS))
def test_global_report_folds_three_ranks_in_rank_order(tmp_path, layout):
    """Note [Rank order needs three ranks]."""
    run_scenario(tmp_path, "rank-order", world=3, layout=layout)


def test_pickling_with_process_groups_is_refused_clearly(tmp_path):
    run_scenario(tmp_path, "pickling-process-groups")


def test_zero_redundancy_optimizer_global_statistics_with_partition_group(tmp_path):
    run_scenario(tmp_path, "zero-global-statistics")
