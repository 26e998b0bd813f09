"""torchtitan (pinned in requirements-torchtitan.txt) with ruda_torch by one flag,
``--override.imports ruda_torch.integrations.torchtitan.adamw`` (Note [torchtitan
integration] in ruda_torch/integrations/torchtitan.py), against stock torchtitan (torch's
AdamW and torchtitan's clip) on the same gradients.

torchtitan's attention has no backward on a CPU, so its real parts are driven with seeded
gradients fed to its debug Llama's parameters: the config tree with ``ConfigManager`` and
``apply_overrides``, ``OptimizersContainer.build``, ``LRSchedulersContainer``,
``dist_utils.clip_grad_norm_`` as the trainer calls it, ``optimizers.step()``, the flat
state dict through torchtitan's own ``CheckpointManager`` (DCP), and on gloo torchtitan's
``parallelize_llama`` (FSDP2 on 2 ranks, FSDP2 + tensor parallel 2x2; its default
``spmd_backend="spmd_types"`` does not shard on a CPU, so the DTensor path,
"partial_dtensor"), with pipeline stages as model parts of one rank and of two ranks.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from optim_harness import CountOps
from test_distributed import run_scenario
from test_ops import same_bits

import ruda_torch

warnings.filterwarnings("ignore", message=".*initial_load_model_only.*")

from torchtitan.components.checkpointer import CheckpointManager  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.config.override import apply_overrides  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402

from ruda_torch.integrations import torchtitan as titan  # noqa: E402

FLAG = "ruda_torch.integrations.torchtitan.adamw"
MAX_NORM = 0.5  # below the fed gradients' norm: every step clips


def config(flag_kwargs: dict | None = None, *, extra=()):
    """The debug Llama's Trainer.Config as the command line makes it, with the flag (and
    its keyword arguments) unless ``flag_kwargs`` is None, overrides applied."""
    args = ["--module", "llama3", "--config", "llama3_debugmodel", *extra]
    if flag_kwargs is not None:
        import json

        args += ["--override.imports", f"{FLAG}={json.dumps(flag_kwargs)}"]
    cfg = ConfigManager().parse_args(args)
    cfg.training.max_norm = MAX_NORM
    apply_overrides(cfg.override, cfg)
    return cfg


def debug_model(dtype=torch.float32):
    torch.manual_seed(0)
    model = config().model_spec.model.build()
    for p in model.parameters():  # its parameters only (RoPE's buffers are complex)
        p.data = p.data.to(dtype)
    return model


def feed(params: list, step: int) -> None:
    """Seeded full gradients, sharded like each parameter (a DTensor's), over binades."""
    for j, p in enumerate(params):
        gen = torch.Generator().manual_seed(1000 * step + j)
        g = torch.randn(p.shape, generator=gen) * torch.rand(p.shape, generator=gen).pow(4)
        g = (g * 1e-2).to(p.dtype)
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = g


def fp64_norm(params: list) -> float:
    return math.sqrt(sum(_full(p.grad).double().pow(2).sum().item() for p in params))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def step(opts, params: list, step_index: int, pp_mesh=None) -> torch.Tensor:
    """One optimizer step as torchtitan's trainer takes it: clip, then step."""
    feed(params, step_index)
    norm = dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=pp_mesh,
                                      ep_enabled=False)  # fmt: skip
    opts.step()
    return norm


def assert_close_params(a: list, b: list, what: str) -> None:
    """To FP32 rounding: the two optimizers evaluate the same formula in other orders and
    their clip coefficients are a few ulps apart (tests/optim_harness.py,
    VS_TORCH_CLIPPED: rtol 2e-6, 8 units of the tensor's largest element)."""
    for j, (p, q) in enumerate(zip(a, b, strict=True)):
        p, q = _full(p).float(), _full(q).float()
        atol = 8 * 2.0**-23 * q.abs().max().item()
        torch.testing.assert_close(p, q, rtol=2e-6, atol=atol,
                                   msg=lambda m, j=j: f"{what} {j}: {m}")  # fmt: skip


# ------------------------------------------------------------------ the flag


def test_importing_ruda_torch_imports_no_torchtitan():
    code = "import sys, ruda_torch; assert 'torchtitan' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_torchtitan_without_the_interfaces_is_refused():
    code = (
        "from torchtitan.components.optimizer import OptimizersContainer as O\n"
        "del O._build_param_groups\n"
        "import ruda_torch.integrations.torchtitan\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "tested with torchtitan 0.3.0" in out.stderr
    assert "OptimizersContainer._build_param_groups" in out.stderr


def test_the_flag_builds_ruda_torch_from_torchtitans_config():
    """The optimizer config's groups (patterns, lr, betas, eps, weight decay) and the
    flag's keyword arguments; the stock config untouched without the flag."""
    cfg = config({"state_precision": "8bit", "min_8bit_size": 0})
    assert type(cfg.optimizer) is titan.RudaOptimizersContainer.Config
    cfg.optimizer.param_groups = [
        ParamGroupConfig(pattern=r"norm\.weight$", optimizer_name="AdamW",
                         optimizer_kwargs={"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8,
                                           "weight_decay": 0.0, "state_precision": "fp32"}),
        *cfg.optimizer.param_groups,
    ]  # fmt: skip
    model = debug_model()
    opts = cfg.optimizer.build(model_parts=[model])
    (opt,) = opts.optimizers
    assert type(opt) is ruda_torch.AdamW and opt.hierarchical_stats
    norms, rest = opt.param_groups
    assert all(n.endswith("norm.weight") for n in norms["param_names"])
    assert norms["weight_decay"] == 0.0 and norms["state_precision"] == "fp32"
    assert rest["lr"] == 8e-4 and rest["betas"] == (0.9, 0.95) and rest["eps"] == 1e-8
    assert rest["weight_decay"] == 0.1 and rest["state_precision"] == "8bit"
    assert all(g["fused_step"] for g in opt.param_groups)
    stock = config().optimizer
    assert type(stock) is OptimizersContainer.Config
    assert type(stock.build(model_parts=[debug_model()]).optimizers[0]) is torch.optim.AdamW


def test_a_subclass_of_the_container_is_left_as_it_is():
    """An experiment's own container (torchft's subclasses OptimizersContainer) keeps its
    contract: the flag replaces torchtitan's stock optimizer config only."""
    from dataclasses import dataclass

    class Experiment(OptimizersContainer):
        @dataclass(kw_only=True, slots=True)
        class Config(OptimizersContainer.Config):
            pass

    cfg = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel",
                                      "--override.imports", FLAG])  # fmt: skip
    cfg.optimizer = titan.derive(cfg.optimizer, Experiment.Config)
    apply_overrides(cfg.override, cfg)
    assert type(cfg.optimizer) is Experiment.Config


@pytest.mark.parametrize(
    "kwargs, match",
    [({"max_grad_norm": 1.0}, "comes from training.max_norm"),
     ({"lr": 1.0}, "comes from the optimizer config's param_groups"),
     ({"state_precison": "8bit"}, "unknown option 'state_precison'"),
     ({"state_precision": "4bits"}, "state_precision must be one of")],
)  # fmt: skip
def test_bad_keyword_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        config(kwargs).optimizer.build(model_parts=[debug_model()])


# ------------------------------------------------------------------ one norm per step


def _pair(flag_kwargs=None, parts=1, dtype=torch.float32):
    """Ours and stock torchtitan's containers over twin models (``parts`` model parts of
    one rank: pipeline stages), with their parameter lists."""
    runs = []
    for kwargs in ({} if flag_kwargs is None else flag_kwargs, None):
        cfg = config(kwargs)
        model = debug_model(dtype)
        model_parts = _split(model, parts)
        opts = cfg.optimizer.build(model_parts=model_parts)
        runs.append((opts, [p for m in model_parts for p in m.parameters()]))
    return runs


def _split(model, parts: int) -> list:
    """The model as ``parts`` model parts (pipeline stages on one rank): its layers cut
    in order, the embeddings with the first and the head with the last."""
    if parts == 1:
        return [model]
    layers = list(model.layers.values())
    per = -(-len(layers) // parts)
    out = []
    for k in range(parts):
        part = torch.nn.Module()
        part.layers = torch.nn.ModuleDict(
            {str(k * per + i): layer for i, layer in enumerate(layers[k * per : (k + 1) * per])}
        )
        if k == 0:
            part.tok_embeddings = model.tok_embeddings
        if k == parts - 1:
            part.norm, part.lm_head = model.norm, model.lm_head
        out.append(part)
    return out


def test_the_clip_reads_no_gradient_and_the_step_fills_the_exact_norm():
    (ours, params), _ = _pair()
    feed(params, 0)
    grads = [p.grad.clone() for p in params]
    with CountOps() as counted:
        norm = dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=None,
                                          ep_enabled=False)  # fmt: skip
    assert counted.ops == [], counted.ops[:5]  # no gradient read, no collective
    assert norm is ours.grad_norm and math.isnan(norm.item())
    assert all(same_bits(p.grad, g) for p, g in zip(params, grads, strict=True))
    ours.step()
    want = fp64_norm(params)
    assert abs(norm.item() - want) <= 2e-6 * want
    assert ours.optimizers[0].last_report.clip_coef.item() < 1.0  # it clipped


@pytest.mark.parametrize("parts", [1, 2], ids=["one-part", "two-stages"])
def test_trains_like_stock_torchtitan_on_the_same_gradients(parts):
    (ours, mine), (stock, theirs) = _pair(parts=parts)
    assert len(ours.optimizers) == 1  # one ruda_torch optimizer over every part
    for s in range(4):
        norm = step(ours, mine, s)
        their_norm = step(stock, theirs, s)
        want = fp64_norm(mine)
        # Ours: the sum of squares in one fixed order of FP32 rows (Note [Statistics
        # row]); torch's: per-tensor FP32 norms, then theirs (9e-6 off here).
        assert abs(norm.item() - want) <= 2e-6 * want
        assert abs(their_norm.item() - want) <= 5e-5 * want
        assert_close_params(mine, theirs, f"step {s}")


def test_a_non_finite_gradient_skips_the_step_and_logs_nan():
    (ours, params), _ = _pair({"state_precision": "8bit"})
    step(ours, params, 0)
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(ours.optimizers[0].state_dict()["state"])
    feed(params, 1)
    params[3].grad.view(-1)[7] = float("inf")
    norm = dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=None,
                                      ep_enabled=False)  # fmt: skip
    ours.step()
    assert math.isnan(norm.item()) and ours.skipped_steps.item() == 1
    assert all(same_bits(p.detach(), q) for p, q in zip(params, before, strict=True))
    after = ours.optimizers[0].state_dict()["state"]
    for i, entry in state.items():
        for k, v in entry.items():
            assert same_bits(after[i][k], v), (i, k)
    norm = step(ours, params, 2)  # and training goes on
    assert math.isfinite(norm.item()) and ours.skipped_steps.item() == 1


def test_a_stock_optimizer_in_the_same_process_clips_and_steps_as_before():
    """Ours built first (torchtitan's clip and checkpoint load are routed): a stock
    container's clip_grad_norm_ is torchtitan's own, bit for bit, and so is its step."""
    (ours, mine), (stock, theirs) = _pair()
    step(ours, mine, 0)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    opt = torch.optim.AdamW(twin, lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=True)  # fmt: skip
    for s in range(2):
        feed(theirs, s)
        feed(twin, s)
        norm = dist_utils.clip_grad_norm_(theirs, MAX_NORM, foreach=True, pp_mesh=None,
                                          ep_enabled=False)  # fmt: skip
        want = titan._ORIGINAL["clip"](twin, MAX_NORM, foreach=True, pp_mesh=None,
                                       ep_enabled=False)  # fmt: skip
        assert same_bits(norm, want)
        assert all(same_bits(p.grad, q.grad) for p, q in zip(theirs, twin, strict=True))
        stock.step()
        opt.step()
        assert all(same_bits(p.detach(), q.detach()) for p, q in zip(theirs, twin, strict=True))
    assert dist_utils.clip_grad_norm_ is titan._clip_grad_norm_


def test_parameters_of_another_optimizer_beside_ours_are_clipped_by_torchtitan():
    """Where clip_grad_norm_ gets parameters that are not all ours (another optimizer's
    beside ours), torchtitan's own clip runs over all of them, in place, and our step
    does not clip a second time."""
    (ours, params), _ = _pair()
    extra = torch.nn.Parameter(torch.randn(64, 64))
    feed(params, 0)
    extra.grad = torch.full_like(extra, 0.5)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params + [extra]]
    for p, q in zip(params + [extra], twin, strict=True):
        q.grad = p.grad.clone()
    norm = dist_utils.clip_grad_norm_(params + [extra], MAX_NORM, foreach=True, pp_mesh=None,
                                      ep_enabled=False)  # fmt: skip
    want = titan._ORIGINAL["clip"](twin, MAX_NORM, foreach=True, pp_mesh=None, ep_enabled=False)
    assert same_bits(norm, want) and same_bits(params[0].grad, twin[0].grad)  # clipped
    (opt,) = ours.optimizers
    ref = ruda_torch.AdamW(twin[:-1], lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                           fused_step=True, hierarchical_stats=True)  # fmt: skip
    ours.step()
    ref.step()
    assert opt.max_grad_norm is None
    assert all(same_bits(p.detach(), q.detach()) for p, q in zip(params, twin[:-1], strict=True))


def test_adam_and_adamw_groups_step_as_torchtitans_two_optimizers():
    """An Adam group (L2 decay) beside AdamW ones: one ruda_torch.Adam over both, each
    group with its decay (torchtitan builds a torch Adam and a torch AdamW)."""
    runs = []
    for kwargs in ({}, None):
        cfg = config(kwargs)
        default = cfg.optimizer.param_groups[0]
        norms = ParamGroupConfig(pattern=r"norm\.weight$", optimizer_name="Adam",
                                 optimizer_kwargs={**default.optimizer_kwargs,
                                                   "weight_decay": 0.01})  # fmt: skip
        cfg.optimizer.param_groups = [norms, default]
        model = debug_model()
        runs.append((cfg.optimizer.build(model_parts=[model]), list(model.parameters())))
    (ours, mine), (stock, theirs) = runs
    assert [type(o) for o in ours.optimizers] == [ruda_torch.Adam]
    assert sorted(type(o).__name__ for o in stock.optimizers) == ["Adam", "AdamW"]
    for s in range(3):
        step(ours, mine, s)
        step(stock, theirs, s)
        assert_close_params(mine, theirs, f"step {s}")


def test_fused_opt_states_bf16_is_bf16_states():
    cfg = config({}, extra=["--optimizer.implementation", "fused_opt_states_bf16"])
    opts = cfg.optimizer.build(model_parts=[debug_model()])
    assert opts.optimizers[0].param_groups[0]["state_precision"] == "bf16"


# ------------------------------------------------------------------ checkpoints


class _TrainState:
    """The trainer's own entry of the checkpoint (its step), as torchtitan's Trainer."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


def checkpointer(cfg, opts, model_parts, folder) -> CheckpointManager:
    """torchtitan's own CheckpointManager (DCP) over the run, as its Trainer builds it."""
    ck = cfg.checkpoint
    ck.enable, ck.folder, ck.interval, ck.keep_latest_k = True, str(folder), 1, 0
    ck.last_save_model_only = False
    schedulers = cfg.lr_scheduler.build(optimizers=opts, training_steps=cfg.training.steps)
    return ck.build(dataloader=None, model_parts=model_parts, optimizers=opts,
                    lr_schedulers=schedulers, states={"train_state": _TrainState()},
                    sd_adapter=None)  # fmt: skip


def run(flag_kwargs, dtype=torch.float32):
    """A run of ours (or stock's, ``flag_kwargs`` None): config, model, container."""
    cfg = config(flag_kwargs)
    model = debug_model(dtype)
    return cfg, model, cfg.optimizer.build(model_parts=[model])


def snapshot(model, opts) -> list:
    out = [p.detach().clone() for p in model.parameters()]
    for optim in opts.optimizers:
        for _, entry in sorted(optim.state_dict()["state"].items()):
            out += [v.clone() for _, v in sorted(entry.items())]
    return out


def assert_same(a: list, b: list, what: str) -> None:
    assert len(a) == len(b), what
    for j, (x, y) in enumerate(zip(a, b, strict=True)):
        assert same_bits(x, y), f"{what}: tensor {j}"


FORMS = {
    "fp32": ({}, torch.float32),
    "bf16": ({"state_precision": "bf16"}, torch.float32),
    "8bit": ({"state_precision": "8bit"}, torch.float32),
    "8bit-master": ({"state_precision": "8bit", "master_weights": True}, torch.bfloat16),
    "remainder": ({"state_precision": "bf16", "master_weights": "remainder"}, torch.bfloat16),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_checkpoints_resume_bit_for_bit(form, tmp_path):
    """Saved by torchtitan's CheckpointManager after 3 steps and loaded into a fresh run:
    the next 2 steps give the bits of the run that did not stop."""
    kwargs, dtype = FORMS[form]
    cfg, model, opts = run(kwargs, dtype)
    ck = checkpointer(cfg, opts, [model], tmp_path)
    params = list(model.parameters())
    for s in range(3):
        step(opts, params, s)
    ck.save(curr_step=3)
    for s in range(3, 5):
        step(opts, params, s)
    want = snapshot(model, opts)
    cfg2, model2, opts2 = run(kwargs, dtype)
    assert checkpointer(cfg2, opts2, [model2], tmp_path).load(step=3)
    params2 = list(model2.parameters())
    for s in range(3, 5):
        step(opts2, params2, s)
    assert_same(snapshot(model2, opts2), want, form)


@pytest.mark.parametrize("form", list(FORMS))
def test_init_optim_state_changes_no_parameter_and_no_moment(form):
    """torchtitan's lr=0, zero-gradient step before its first save or load: every key is
    created, no parameter moves, every moment is zero, the counter is stock's."""
    kwargs, dtype = FORMS[form]
    _, model, opts = run(kwargs, dtype)
    before = [p.detach().clone() for p in model.parameters()]
    sd = opts.state_dict()  # runs init_optim_state
    assert all(same_bits(p.detach(), q) for p, q in zip(model.parameters(), before, strict=True))
    (opt,) = opts.optimizers
    values = ruda_torch.dequantize_state_dict(opt.state_dict())["state"]
    for entry in values.values():
        assert not entry["exp_avg"].any() and not entry["exp_avg_sq"].any()
    _, stock_model, stock = run(None)
    stock_sd = stock.state_dict()
    steps = {k for k in sd if k.endswith(".step")}
    assert steps == {k for k in stock_sd if k.endswith(".step")}
    assert all(same_bits(sd[k], stock_sd[k]) for k in steps)
    if "master_weights" in kwargs:
        key = "master_param" if kwargs["master_weights"] is True else "master_remainder"
        assert any(k.endswith(key) for k in sd)


@pytest.mark.parametrize("form", ["fp32", "bf16", "8bit", "8bit-master"])
def test_a_stock_checkpoint_loads_and_ours_loads_into_stock(form, tmp_path):
    """Stock torchtitan's checkpoint (FP32 moments, no master) into ours with any form:
    each moment what our load makes of torch's (quantized, rounded, or as it is), the
    master from the parameter; then ours, saved, into stock torchtitan, through a resume
    with the FP32 form (docs/integrations.md): the moments ours held, as values."""
    kwargs, dtype = FORMS[form]
    cfg, model, stock = run(None, dtype)
    params = list(model.parameters())
    for s in range(2):
        step(stock, params, s)
    checkpointer(cfg, stock, [model], tmp_path / "stock").save(curr_step=2)
    torch_state = stock.optimizers[0].state_dict()
    # Stock into ours: the same as ruda_torch.AdamW.load_state_dict of torch's state dict.
    cfg2, model2, ours = run(kwargs, dtype)
    assert checkpointer(cfg2, ours, [model2], tmp_path / "stock").load(step=2)
    assert all(same_bits(p.detach(), q.detach())
               for p, q in zip(model2.parameters(), params, strict=True))  # fmt: skip
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin_opt = ruda_torch.AdamW(twin, fused_step=True, hierarchical_stats=True, **kwargs)
    twin_opt.load_state_dict(torch_state)
    step(ours, list(model2.parameters()), 2)
    feed(twin, 2)
    twin_opt.max_grad_norm = MAX_NORM  # as the flag's clip sets it
    twin_opt.step()
    assert all(same_bits(p.detach(), q.detach())
               for p, q in zip(model2.parameters(), twin, strict=True))  # fmt: skip
    got = ours.optimizers[0].state_dict()["state"]
    for i, entry in twin_opt.state_dict()["state"].items():
        for k, v in entry.items():
            assert same_bits(got[i][k], v), (i, k)
    # Ours back into stock, through a resume with the FP32 form.
    checkpointer(cfg2, ours, [model2], tmp_path / "ours").save(curr_step=3)
    cfg3, model3, fp32 = run({}, dtype)
    assert checkpointer(cfg3, fp32, [model3], tmp_path / "ours").load(step=3)
    checkpointer(cfg3, fp32, [model3], tmp_path / "fp32").save(curr_step=3)
    cfg4, model4, stock4 = run(None, dtype)
    assert checkpointer(cfg4, stock4, [model4], tmp_path / "fp32").load(step=3)
    values = ruda_torch.dequantize_state_dict(ours.optimizers[0].state_dict())["state"]
    loaded = stock4.optimizers[0].state_dict()["state"]
    for i, entry in values.items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert same_bits(loaded[i][k], entry[k].to(loaded[i][k].dtype)), (i, k)


# ------------------------------------------------------------------ meshes (gloo)


def parallel_model(tp: int, pp: int = 1):
    """The debug Llama sharded by torchtitan's own parallelize_llama (FSDP2 over the
    ranks, tensor parallel ``tp``) on this rank's gloo mesh, and its ParallelDims."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.parallelize import parallelize_llama

    # torchtitan takes "cuda" as the device where it finds no accelerator.
    parallel_dims.device_type = "cpu"
    cfg = config()
    cfg.parallelism.spmd_backend = "partial_dtensor"
    cfg.parallelism.tensor_parallel_degree = tp
    cfg.parallelism.pipeline_parallel_degree = pp
    dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
    dims.build_mesh()
    cfg.model_spec.model.update_from_config(config=cfg)  # as the Trainer: sharding configs
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cfg.model_spec.model.build()
    if pp == 1:
        parallelize_llama(model, parallel_dims=dims, training=cfg.training,
                          parallelism=cfg.parallelism, compile_config=cfg.compile,
                          ac_config=None, dump_folder="")  # fmt: skip
    model.to_empty(device="cpu")
    with torch.no_grad():
        torch.manual_seed(0)
        model.init_states()
    return model, dims


def _checksum(t: torch.Tensor) -> int:
    """A checksum of a tensor's bits (replicas on other ranks compare by it)."""
    bits = t.detach().contiguous().view(-1).view(torch.uint8).to(torch.int64)
    return int((bits * torch.arange(1, bits.numel() + 1) % 65521).sum())


def assert_same_bits_on_every_rank(params: list, norm: torch.Tensor) -> None:
    """The norm, and every rank's local shard of each parameter against the other ranks
    holding the same shard (replicas: HSDP, tensor parallelism's Replicate), the same
    bits."""
    mine = [_checksum(norm)]
    for p in params:
        coords = tuple(c if not pl.is_replicate() else -1
                       for c, pl in zip(p.device_mesh.get_coordinate(), p.placements, strict=True))  # fmt: skip
        mine.append((coords, _checksum(p.to_local())))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    assert all(r[0] == mine[0] for r in every), "the norm differs between ranks"
    for j in range(1, len(mine)):
        seen = {}
        for r in every:
            coords, value = r[j]
            assert seen.setdefault(coords, value) == value, f"parameter {j - 1}: replicas differ"


def scenario_mesh(rank: int, workdir: str, tp: int) -> None:
    """FSDP2 (and tensor parallelism) by torchtitan's parallelize: ours (FP32 moments)
    against stock on the same full gradients (norm against FP64, parameters to FP32
    rounding), ours with 8-bit moments the same bits on every rank, and a non-finite
    gradient on one rank skipping the step on all."""
    models = [parallel_model(tp)[0] for _ in range(3)]
    with torch.no_grad():
        for ps in zip(*(m.parameters() for m in models), strict=True):
            for q in ps[1:]:
                q.to_local().copy_(ps[0].to_local())
    ours = config({}).optimizer.build(model_parts=[models[0]])
    stock = config().optimizer.build(model_parts=[models[1]])
    low_cfg = config({"state_precision": "8bit"})
    if tp > 1:  # Rowwise tensor parallelism cuts the debug model's rows of 256 into parts
        # of 128, not whole 8-bit blocks: those parameters keep BF16 moments, by pattern
        # (Note [8-bit blocks on every mesh] in ruda_torch/_state8bit.py).
        default = low_cfg.optimizer.param_groups[0]
        rowwise = ParamGroupConfig(
            pattern=r"(attention\.wo|feed_forward\.w2)\.weight$", optimizer_name="AdamW",
            optimizer_kwargs={**default.optimizer_kwargs, "state_precision": "bf16"})  # fmt: skip
        low_cfg.optimizer.param_groups = [rowwise, default]
    low = low_cfg.optimizer.build(model_parts=[models[2]])
    a, b, c = (list(m.parameters()) for m in models)
    for s in range(3):
        norm, their_norm, low_norm = step(ours, a, s), step(stock, b, s), step(low, c, s)
        want = fp64_norm(a)
        assert abs(norm.item() - want) <= 2e-6 * want, (norm.item(), want)
        assert abs(their_norm.item() - want) <= 5e-5 * want
        assert same_bits(low_norm, norm)  # the same gradients: the same statistics
        assert_close_params(a, b, f"step {s}")
        assert_same_bits_on_every_rank(a, norm)
        assert_same_bits_on_every_rank(c, low_norm)
    before = [_full(p) for p in c]
    feed(c, 3)
    if rank == 1:  # a parameter of which every rank holds another part (no replica:
        # replicas are the same gradients in training, a Replicate placement and tensor
        # parallelism's copies of a parameter FSDP2 alone shards are counted once)
        world = dist.get_world_size()
        sharded = next(p for p in c if p.device_mesh.size() == world
                       and not any(pl.is_replicate() for pl in p.placements))  # fmt: skip
        sharded.grad.to_local().view(-1)[0] = float("nan")
    norm = dist_utils.clip_grad_norm_(c, MAX_NORM, foreach=True, pp_mesh=None, ep_enabled=False)
    low.step()
    assert math.isnan(norm.item()) and low.skipped_steps.item() == 1
    assert all(same_bits(_full(p), q) for p, q in zip(c, before, strict=True))


@pytest.mark.distributed
@pytest.mark.parametrize("world, tp", [(2, 1), (4, 2)], ids=["fsdp2-2", "fsdp2-tp-2x2"])
def test_meshes_like_stock_torchtitan(tmp_path, world, tp):
    run_scenario(tmp_path, "test_torchtitan:scenario_mesh", world=world, tp=tp)


def scenario_pipeline(rank: int, workdir: str) -> None:
    """Two pipeline stages on two ranks (each rank's model part: its half of the layers):
    the norm is the whole model's (the stages' reports summed over the pipeline mesh
    torchtitan's trainer passes to clip_grad_norm_), as stock torchtitan's."""
    from torch.distributed.device_mesh import init_device_mesh

    pp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    parts = []
    for _ in range(2):
        model = debug_model()
        parts.append(_split(model, 2)[rank])
    ours = config({}).optimizer.build(model_parts=[parts[0]])
    stock = config().optimizer.build(model_parts=[parts[1]])
    a, b = list(parts[0].parameters()), list(parts[1].parameters())
    for s in range(2):
        feed(a, s + 10 * rank)
        feed(b, s + 10 * rank)
        norm = dist_utils.clip_grad_norm_(a, MAX_NORM, foreach=True, pp_mesh=pp_mesh,
                                          ep_enabled=False)  # fmt: skip
        their_norm = dist_utils.clip_grad_norm_(b, MAX_NORM, foreach=True, pp_mesh=pp_mesh,
                                                ep_enabled=False)  # fmt: skip
        squares = torch.tensor(sum(p.grad.double().pow(2).sum().item() for p in a),
                               dtype=torch.float64)  # fmt: skip
        dist.all_reduce(squares)
        want = math.sqrt(squares.item())
        ours.step()
        stock.step()
        assert abs(norm.item() - want) <= 2e-6 * want, (norm.item(), want)
        assert abs(their_norm.item() - want) <= 5e-5 * want
        norms = [None, None]
        dist.all_gather_object(norms, norm.item())
        assert norms[0] == norms[1]
        assert_close_params(a, b, f"step {s}")


@pytest.mark.distributed
@pytest.mark.parametrize("_", [0], ids=["pp-2"])
def test_pipeline_stages_share_one_norm(tmp_path, _):
    run_scenario(tmp_path, "test_torchtitan:scenario_pipeline", world=2)


def full_state(model, opts) -> dict:
    """Every parameter and its optimizer state, unsharded, by name."""
    (opt,) = opts.optimizers
    names = [n for g in opt.param_groups for n in g["param_names"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    return {n: (_full(p).clone(), {k: _full(v).clone() for k, v in sorted(opt.state[p].items())})
            for n, p in zip(names, params, strict=True)}  # fmt: skip


def scenario_dcp(rank: int, workdir: str, phase: str) -> None:
    """8-bit states and FP32 masters... saved by torchtitan's CheckpointManager on 4 FSDP2
    ranks after 2 steps ("save"), loaded on 2 ("load"): the full state the same bits,
    and the next step the same as the 4 ranks'."""
    model, _ = parallel_model(1)
    cfg = config({"state_precision": "8bit"})
    opts = cfg.optimizer.build(model_parts=[model])
    ck = checkpointer(cfg, opts, [model], f"{workdir}/../ckpt")
    params = list(model.parameters())
    if phase == "save":
        for s in range(2):
            step(opts, params, s)
        ck.save(curr_step=2)
        saved = full_state(model, opts)
        step(opts, params, 2)
        after = full_state(model, opts)
        if rank == 0:
            torch.save({"saved": saved, "after": after}, f"{workdir}/../want.pt")
        return
    want = torch.load(f"{workdir}/../want.pt", weights_only=True)
    assert ck.load(step=2)
    for name, (p, entry) in full_state(model, opts).items():
        assert same_bits(p, want["saved"][name][0]), name
        for k, v in entry.items():
            assert same_bits(v, want["saved"][name][1][k]), (name, k)
    step(opts, params, 2)
    for name, (p, entry) in full_state(model, opts).items():
        assert same_bits(p, want["after"][name][0]), name
        for k, v in entry.items():
            assert same_bits(v, want["after"][name][1][k]), (name, k)


@pytest.mark.distributed
def test_dcp_checkpoints_reshard_4_to_2(tmp_path):
    for phase, world in (("save", 4), ("load", 2)):
        where = tmp_path / phase
        where.mkdir()
        run_scenario(where, "test_torchtitan:scenario_dcp", world=world, phase=phase)
