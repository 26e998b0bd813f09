"""torchtitan trains with ruda_torch by one flag (docs/integrations.md, "torchtitan"):

    --override.imports ruda_torch.integrations.torchtitan.adamw
    --override.imports 'ruda_torch.integrations.torchtitan.adamw={"state_precision": "8bit"}'

Tested with torchtitan 0.3.0 (``TESTED_WITH``). Importing this module imports torchtitan
(``import ruda_torch`` does not) and refuses, naming what is missing, a torchtitan whose
interfaces it does not find.

Note [torchtitan integration]
torchtitan swaps a configurable component through its override mechanism
(torchtitan/config/override.py): ``adamw`` replaces the optimizer config
(``OptimizersContainer.Config``) by ours, whose container builds one ruda_torch optimizer
(``fused_step=True``, ``hierarchical_stats=True``) over every AdamW and Adam param group of
every model part of the rank, with lr, betas, eps, weight decay and the group patterns
still read from torchtitan's config and ruda_torch's options from the flag's keyword
arguments (a group's ``optimizer_kwargs`` may set them per group too). Two calls of
torchtitan's trainer then reach ruda_torch's, for our containers only; for any other
optimizer they run torchtitan's own code, unchanged:
* ``torchtitan.distributed.utils.clip_grad_norm_`` (before ``optimizers.step()``) reads no
  gradient and starts no collective: it hands ``training.max_norm`` (and the pipeline
  mesh, whose stages own disjoint parameters: the optimizer's ``partition_group``) to the
  optimizer and returns a 0-d tensor that the step fills with the global norm of every
  model part on every rank, stage and expert mesh (the statistics pass, which also clips),
  or NaN for a step it skipped for non-finite gradients, with no host sync. Where the
  parameters are not all ours (another optimizer beside ours), torchtitan's clip runs as
  it is and our step does not clip again;
* ``CheckpointManager.dcp_load`` loads our optimizer through a template matched to the
  checkpoint (``ruda_torch.match_checkpoint``): a checkpoint of torch's AdamW or of
  another state_precision or master form loads, converted.
The flat optimizer state dict (``state.<fqn>.<key>``, ``param_groups.<fqn>.<option>``) is
torchtitan's, with the group options of torch's AdamW only: ruda_torch's (state_precision,
master_weights, ...) come from the command line on every run, so that a resume with other
ones converts the state instead of reverting to the checkpoint's.
"""

from __future__ import annotations

import inspect
import math
import weakref
from dataclasses import dataclass, field, fields

import torch

import ruda_torch

TESTED_WITH = ("0.3.0",)

try:
    import torchtitan
    from torchtitan.components.checkpointer import OPTIMIZER
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.utils import (
        get_flat_optim_state_dict,
        init_optim_state,
        load_flat_optim_state_dict,
    )
    from torchtitan.config.override import derive, override
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools.logging import logger
except ImportError as e:
    raise ImportError(
        f"ruda_torch.integrations.torchtitan needs torchtitan (tested with torchtitan "
        f"{', '.join(TESTED_WITH)}: pip install torchtitan=={TESTED_WITH[-1]}): {e}"
    ) from e

__all__ = ["TESTED_WITH", "RudaOptimizersContainer", "adamw"]


def _missing_interfaces() -> list[str]:
    """What of torchtitan this module uses that this torchtitan lacks."""
    missing = []
    config_fields = {f.name for f in fields(OptimizersContainer.Config)}
    for name in ("param_groups", "implementation", "optimizer_factory_kwargs_by_name"):
        if name not in config_fields:
            missing.append(f"OptimizersContainer.Config.{name}")
    for name in ("_build_param_groups", "_build_impl_kwargs", "_resolve_optimizer_factory",
                 "_validate_params", "_post_init", "_log_optimizer"):  # fmt: skip
        if not callable(getattr(OptimizersContainer, name, None)):
            missing.append(f"OptimizersContainer.{name}")
    wanted = {
        "torchtitan.distributed.utils.clip_grad_norm_": (
            getattr(dist_utils, "clip_grad_norm_", None),
            ("parameters", "max_norm", "norm_type", "error_if_nonfinite", "foreach", "pp_mesh",
             "ep_enabled"),
        ),
        "CheckpointManager.dcp_load": (
            getattr(CheckpointManager, "dcp_load", None),
            ("self", "state_dict", "checkpoint_id", "from_hf", "from_quantized"),
        ),
    }  # fmt: skip
    for name, (fn, params) in wanted.items():
        try:
            found = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            found = None
        if found != params:
            missing.append(f"{name}{params}")
    return missing


_MISSING = _missing_interfaces()
if _MISSING:
    raise RuntimeError(
        f"ruda_torch.integrations.torchtitan was tested with torchtitan "
        f"{', '.join(TESTED_WITH)} and does not find these interfaces in torchtitan "
        f"{getattr(torchtitan, '__version__', '?')}: {', '.join(_MISSING)}. Install "
        f"torchtitan=={TESTED_WITH[-1]}, or use ruda_torch.AdamW directly"
    )
if getattr(torchtitan, "__version__", None) not in TESTED_WITH:
    logger.warning(
        f"ruda_torch.integrations.torchtitan: tested with torchtitan {', '.join(TESTED_WITH)}, "
        f"this is {getattr(torchtitan, '__version__', '?')} (its interfaces were found)"
    )


def _probe_groups() -> tuple[set, set]:
    """The group options of torch's AdamW, and those that ruda_torch's adds."""
    p = torch.nn.Parameter(torch.zeros(1))
    torch_keys = set(torch.optim.AdamW([p]).param_groups[0]) - {"params"}
    ours = set(ruda_torch.AdamW([p]).param_groups[0]) - {"params"}
    return torch_keys, ours - torch_keys


_TORCH_GROUP_KEYS, _RUDA_GROUP_KEYS = _probe_groups()
# Constructor keywords this integration sets (Note [torchtitan integration]), and where
# they come from instead.
_SET_HERE = {
    "hierarchical_stats": "always True: the statistics pass clips and skips",
    "max_grad_norm": "training.max_norm",
    "partition_group": "the pipeline mesh torchtitan's trainer passes to clip_grad_norm_",
    "process_group": "the parameters' DTensor meshes",
    "fused_step": "always True",
    "fused": "always True",
    "foreach": "always False",
    "lr": "the optimizer config's param_groups",
    "betas": "the optimizer config's param_groups",
    "eps": "the optimizer config's param_groups",
    "weight_decay": "the optimizer config's param_groups",
}
_KEYWORDS = set(inspect.signature(ruda_torch.AdamW).parameters) - {"params"}


def _check_kwargs(kwargs: dict) -> dict:
    for k in kwargs:
        if k in _SET_HERE:
            raise ValueError(
                f"ruda_torch.integrations.torchtitan.adamw: {k!r} is not an option of the "
                f"flag; it comes from {_SET_HERE[k]}"
            )
        if k not in _KEYWORDS and k != "decoupled_weight_decay":
            raise ValueError(
                f"ruda_torch.integrations.torchtitan.adamw: unknown option {k!r}; the flag "
                f"takes ruda_torch.AdamW's options: {sorted(_KEYWORDS - set(_SET_HERE))}"
            )
    return dict(kwargs)


class RudaOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` whose AdamW and Adam param groups, of every
    model part, are stepped by one ``ruda_torch`` optimizer (Note [torchtitan integration]
    in ruda_torch/integrations/torchtitan.py); other optimizer names (``DistMuon``) are
    built as torchtitan builds them. ``grad_norm`` is the 0-d tensor that the step fills
    with the global gradient norm (NaN for a skipped step), ``skipped_steps`` a 0-d device
    tensor counting the steps skipped for non-finite gradients."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        ruda_kwargs: dict = field(default_factory=dict)
        """Keyword arguments of ruda_torch.AdamW (state_precision, master_weights,
        min_8bit_size, stochastic_rounding, ...): the defaults of every group."""

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        kwargs = _check_kwargs(config.ruda_kwargs)
        if config.implementation == "fused_opt_states_bf16":
            kwargs.setdefault("state_precision", "bf16")
        impl_kwargs = {"fused": True, "foreach": False}
        self.optimizers = []
        self.model_parts = model_parts
        all_params, ours, patterns = [], [], []
        for part_idx, model in enumerate(model_parts):
            groups, by_name = self._build_param_groups(model, config.param_groups, impl_kwargs)
            for name, opt_groups in groups.items():
                for group in opt_groups:
                    all_params.extend(group["params"])
                if name in ("AdamW", "Adam"):
                    for group in opt_groups:
                        group["decoupled_weight_decay"] = name == "AdamW"
                    ours.extend(opt_groups)
                    patterns.extend(f"{p} (part {part_idx})" for p in by_name[name])
                    continue
                optimizer = self._resolve_optimizer_factory(name)(  # torchtitan's own build
                    opt_groups, **config.optimizer_factory_kwargs_by_name.get(name, {})
                )
                self.optimizers.append(optimizer)
                self._log_optimizer(optimizer, part_idx, by_name[name])
        self._ruda = None
        if ours:
            adamw_only = all(g["decoupled_weight_decay"] for g in ours)
            if adamw_only:
                for g in ours:
                    del g["decoupled_weight_decay"]
            cls = ruda_torch.AdamW if adamw_only else ruda_torch.Adam
            self._ruda = cls(ours, **kwargs, fused=True, hierarchical_stats=True)
            self.optimizers.append(self._ruda)
            self._log_optimizer(self._ruda, "all", patterns)
        self._validate_params(all_params)
        self._post_init(all_params)
        self._ruda_params = (
            {id(p) for g in self._ruda.param_groups for p in g["params"]} if self._ruda else set()
        )
        device = _local(all_params[0]).device if all_params else torch.device("cpu")
        self.grad_norm = torch.full((), math.nan, device=device)
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=device)
        self._clipped_outside = False
        _install(self)

    # ------------------------------------------------------------------ clipping
    def defer_clip(self, max_norm, norm_type, error_if_nonfinite, pp_mesh) -> torch.Tensor:
        """torchtitan's clip_grad_norm_ for parameters that are all ours: no gradient read,
        no collective; the step clips by ``max_norm`` and fills the returned tensor."""
        if float(norm_type) != 2.0:
            raise ValueError(
                f"ruda_torch clips by the 2-norm of the gradients (its statistics pass); "
                f"clip_grad_norm_ was called with norm_type={norm_type}"
            )
        if error_if_nonfinite:
            raise ValueError(
                "ruda_torch skips a step with non-finite gradients instead of raising (that "
                "needs no host sync): call clip_grad_norm_ with error_if_nonfinite=False"
            )
        value = float(max_norm)
        if math.isnan(value) or value <= 0:
            raise ValueError(
                f"training.max_norm must be positive (or inf: no clipping), got {max_norm}"
            )
        group = None if pp_mesh is None else pp_mesh.get_group()
        # Optimizer-wide options that every step reads, checked when set (docs/usage.md).
        if group is not self._ruda.partition_group:
            self._ruda.partition_group = group
        self._ruda.max_grad_norm = None if math.isinf(value) else value
        self._clipped_outside = False
        return self.grad_norm

    def clipped_outside(self) -> None:
        """torchtitan's own clip ran over our parameters and others': no second clip."""
        self._ruda.max_grad_norm = None
        self._clipped_outside = True

    def step(self, closure=None) -> None:
        assert closure is None, "OptimizersContainer does not support closures"
        for optimizer in self.optimizers:
            optimizer.step()
        report = getattr(self._ruda, "last_report", None)
        if report is not None and not self._clipped_outside:
            skipped = report.skipped
            self.grad_norm.copy_(torch.where(skipped, math.nan, report.grad_norm))
            self.skipped_steps += skipped

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """torchtitan's flat state dict, without ruda_torch's group options (Note
        [torchtitan integration])."""
        result = {}
        for optim in self.optimizers:
            init_optim_state(optim)
            flat = get_flat_optim_state_dict(optim)
            if optim is self._ruda:
                flat = {k: v for k, v in flat.items()
                        if not (k.startswith("param_groups.")
                                and k.rpartition(".")[2] in _RUDA_GROUP_KEYS)}  # fmt: skip
            result.update(flat)
        return result

    def load_state_dict(self, state_dict: dict) -> None:
        for optim in self.optimizers:
            init_optim_state(optim)
            if optim is self._ruda:
                optim.load_state_dict(_unflatten(optim, state_dict))
            else:
                load_flat_optim_state_dict(optim, state_dict)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _unflatten(optim, flat: dict) -> dict:
    """The integer-keyed state dict of ruda_torch optimizer ``optim`` from torchtitan's flat
    one: each parameter's entry with whatever keys the flat dict holds for it (another
    state_precision's, torch's: load_state_dict converts), the group options it holds
    (the others are the optimizer's own, ruda_torch's always: Note [torchtitan
    integration])."""
    entries: dict = {}
    for key, value in flat.items():
        if key.startswith("state."):
            fqn, _, name = key[len("state.") :].rpartition(".")
            entries.setdefault(fqn, {})[name] = value
    state, groups, index = {}, [], 0
    for group in optim.param_groups:
        fqns = group["param_names"]
        ids = list(range(index, index + len(fqns)))
        for i, fqn in zip(ids, fqns, strict=True):
            if entries.get(fqn):
                state[i] = entries[fqn]
        index += len(fqns)
        g = {"params": ids, "param_names": list(fqns)}
        for k in group:
            key = f"param_groups.{fqns[0]}.{k}" if fqns else None
            if k not in ("params", "param_names") and k not in _RUDA_GROUP_KEYS and key in flat:
                g[k] = flat[key]
        groups.append(g)
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------- torchtitan's calls

_CONTAINERS: weakref.WeakSet = weakref.WeakSet()
_ORIGINAL: dict = {}


def _install(container: RudaOptimizersContainer) -> None:
    """Route torchtitan's clip and checkpoint load through our containers (Note
    [torchtitan integration]); once per process, for every container built after."""
    _CONTAINERS.add(container)
    if _ORIGINAL:
        return
    _ORIGINAL["clip"] = dist_utils.clip_grad_norm_
    _ORIGINAL["dcp_load"] = CheckpointManager.dcp_load
    dist_utils.clip_grad_norm_ = _clip_grad_norm_
    CheckpointManager.dcp_load = _dcp_load


def _owner(params: list) -> tuple[RudaOptimizersContainer | None, bool]:
    """The container whose optimizer steps the parameters with gradients among
    ``params``, and whether it steps all of them (else some belong to another)."""
    ids = {id(p) for p in params if p.grad is not None}
    for container in list(_CONTAINERS):
        if container._ruda is not None and ids & container._ruda_params:
            return container, ids <= container._ruda_params
    return None, False


def _clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                     error_if_nonfinite: bool = False, foreach: bool | None = None,
                     pp_mesh=None, ep_enabled: bool = False) -> torch.Tensor:  # fmt: skip
    """torchtitan's ``clip_grad_norm_``: deferred to the step for our parameters (Note
    [torchtitan integration]), torchtitan's own otherwise."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    container, whole = _owner(params)
    if container is not None and whole:
        return container.defer_clip(max_norm, norm_type, error_if_nonfinite, pp_mesh)
    norm = _ORIGINAL["clip"](params, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh,
                             ep_enabled)  # fmt: skip
    if container is not None:
        container.clipped_outside()
    return norm


class _MatchedState:
    """Our container as ``dcp.load`` reads it: through a template matched to the
    checkpoint (ruda_torch.match_checkpoint)."""

    def __init__(self, container: RudaOptimizersContainer, checkpoint_id) -> None:
        self.container, self.checkpoint_id = container, checkpoint_id

    def state_dict(self) -> dict:
        template = {OPTIMIZER: self.container.state_dict()}
        return ruda_torch.match_checkpoint(template, self.checkpoint_id)[OPTIMIZER]

    def load_state_dict(self, state_dict: dict) -> None:
        self.container.load_state_dict(state_dict)


def _dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):
    """torchtitan's ``CheckpointManager.dcp_load``, reading our optimizer through a template
    matched to the checkpoint (Note [torchtitan integration])."""
    opt = state_dict.get(OPTIMIZER)
    if not from_hf and isinstance(opt, RudaOptimizersContainer):
        state_dict = {**state_dict, OPTIMIZER: _MatchedState(opt, checkpoint_id)}
    return _ORIGINAL["dcp_load"](self, state_dict, checkpoint_id, from_hf, from_quantized)


# exact=True: a subclass of the container (torchtitan's experiments, e.g. torchft's) has a
# contract of its own that ours does not keep; its config is left as it is (torchtitan then
# warns that the override replaced nothing).
@override(
    target=OptimizersContainer.Config,
    exact=True,
    description="ruda_torch: one native AdamW pass with exact clipping, skipped bad steps, "
    "low-bit states",
)
def adamw(cfg: OptimizersContainer.Config, **kwargs) -> RudaOptimizersContainer.Config:
    """The override factory (``--override.imports ruda_torch.integrations.torchtitan.adamw``,
    keyword arguments ``adamw={"state_precision": "8bit"}``): torchtitan's optimizer config
    with its param groups, lr, betas, eps and weight decay, stepped by ruda_torch."""
    return derive(cfg, RudaOptimizersContainer.Config, ruda_kwargs=_check_kwargs(kwargs))
