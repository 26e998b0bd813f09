"""``ruda_torch.AdamW``: a drop-in ``torch.optim.AdamW`` whose fused path runs one native
in-place kernel per bucket, with optional device-side gradient statistics.

This file is the torch optimizer API (construction, param groups, checkpoints, pickling)
and the order of a step. The pieces live beside it, one concern each:

    _fused.py     the flat buckets and Note [Fused state coherence]: how they stay
                  derived from optimizer.state and param_groups
    _generic.py   the tensor-operation path (fused_step=False)
    _stats.py     gradient statistics and clipping across buckets
    report.py     GradientReport, what a step with statistics leaves in last_report
    _validate.py  argument, state-entry and step-counter checks shared with the
                  functional API

Note [Atomic step]
A step is all or nothing. Everything it will use is checked before the first write:
the hyperparameters of every group, the plan of buckets (derived again if the state or
the groups changed, which validates every state entry), the generic path's parameters
and gradients, and every kernel call of the fused path. When a step makes more than one
kernel call (several groups, devices or gradient dtypes) or creates state first, every
call is validated by ``check_adamw_scaled`` (the kernel's own validation without the
kernel) before the first one runs; a single call validates itself before it writes.
That costs one more pass of the binding's per-parameter checks, in C++, only for steps
with several calls, and keeps one operator per bucket and gradient dtype.
"""

from __future__ import annotations

import copy
import functools
import operator
import warnings
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from . import _C, _fused, _generic, _stats, ops
from ._generic import local
from ._validate import (
    EIGHT_BIT_KEYS,
    MASTER_KEY,
    STATE_KEYS,
    check_hyperparameters,
    check_max_grad_norm,
    check_process_group,
    check_state_entry,
)
from .distributed import ranks_of, scope_of
from .report import GradientReport

__all__ = ["Adam", "AdamW", "GradientReport"]

# torch.optim.AdamW's execution options: kept in every group so that state_dict() has
# torch's exact format, and ignored by this optimizer (whose update is always decoupled).
_TORCH_GROUP_KEYS = dict(
    foreach=None, capturable=False, differentiable=False, fused=None, decoupled_weight_decay=True
)
# The fused path's param-group options besides fused_step, with their defaults.
_FUSED_KEYS = dict(
    master_weights=False,
    stochastic_rounding=False,
    rounding_seed=0,
    flat_grads=False,
    state_precision="fp32",
    state_rounding="stochastic",
    min_8bit_size=4096,
)
# Optimizer-wide options that change the math, and the last report: pickled with the
# optimizer (torch's Optimizer pickles only defaults, state and param_groups).
_OPTIONS = dict(
    hierarchical_stats=False,
    max_grad_norm=None,
    process_group=None,
    partition_group=None,
    last_report=None,
)
# Optimizer-wide options that wrappers copy into group dicts (ZeroRedundancyOptimizer
# passes its keywords both ways, and syncs every group key into ours and back): see
# AdamW._wide_keys_of.
_GROUPS_KEYS = ("process_group", "partition_group")
_WIDE_KEYS = ("hierarchical_stats", "max_grad_norm", *_GROUPS_KEYS)


@dataclass
class _FusedCall:
    """One kernel call: the active parameters of one bucket with one gradient dtype."""

    bucket: _fused.Bucket
    group: dict
    active: list[int]
    grads: list[torch.Tensor]
    gi: int  # index of the param group, for messages
    flat: bool = False  # through the bucket's flat-gradient handle


class AdamW(Optimizer):
    r"""AdamW / AMSGrad with decoupled weight decay, as ``torch.optim.AdamW``, with an
    opt-in native fused path.

    For each parameter with a gradient, at its one-based step :math:`t`:

    .. math::
        g &= \text{grad} \cdot c / s \quad (\text{negated if maximize}) \\
        m &= \beta_1 m + (1 - \beta_1) g \\
        v &= \beta_2 v + (1 - \beta_2) g^2 \\
        \hat v &= \max(\hat v, v) \quad (\text{AMSGrad; stores the uncorrected max}) \\
        p &= p (1 - \gamma \lambda) - \gamma \frac{m / (1 - \beta_1^t)}
             {\sqrt{\hat v / (1 - \beta_2^t)} + \epsilon}

    where :math:`s` is GradScaler's scale (1 without one) and :math:`c` the clip
    coefficient ``min(1, max_grad_norm / (norm + 1e-6))`` (1 without clipping).
    Gradients are never written.

    Args:
        params: parameters or param-group dicts, as for any torch optimizer.
        lr (float, default 1e-3): learning rate :math:`\gamma`.
        betas (tuple[float, float], default (0.9, 0.999)): :math:`\beta_1, \beta_2`.
        eps (float, default 1e-5): :math:`\epsilon`, added outside the square root.
            **torch's default is 1e-8.**
        weight_decay (float, default 1e-4): :math:`\lambda`, decoupled.
            **torch's default is 1e-2.**
        amsgrad (bool, default False): use the AMSGrad maximum.
        maximize (bool, default False): maximize the objective.
        fused_step (bool, default False): run the native in-place kernel on flat
            buckets (Note [Buckets]); a param-group option. Takes FP32, FP64, FP16 and
            BF16 parameters of any layout (FP64 math for FP64, FP32 math and FP32 moments
            for the others). ``False`` is the generic tensor-operation path that works
            anywhere.
        master_weights (bool, default False): for FP16/BF16 parameters of a fused group,
            keep an FP32 master copy (``state[p]["master_param"]``) that the kernel
            updates, writing the parameter rounded to nearest even from it in the same
            pass (Note [Master weights]). A param-group option.
        flat_grads (bool, default False): for a fused group, make every ``p.grad`` a view
            of one flat gradient buffer per bucket, laid out like the state, which
            backward accumulates into in place; ``zero_grad()`` fills the buffer with
            zeros, and a step checks one address per parameter instead of gathering its
            gradient (Note [Flat gradient buckets]; docs/usage.md says what a user sees).
            A param-group option.
        stochastic_rounding (bool, default False): for BF16 parameters of a fused group
            without master weights, round the FP32 result to BF16 stochastically
            (unbiased), reproducibly from ``rounding_seed`` (int, default 0), the step
            counter and the element's position. Param-group options.
        state_precision (str, default ``"fp32"``): how a fused group stores its moments
            (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``): ``"fp32"`` (FP64 for FP64
            parameters), or ``"bf16"``, half the state memory and traffic (Note
            [Low-precision states] in csrc/adamw_math.h; not for FP64 parameters). The
            update uses the moments computed in FP32; only their storage is rounded, as
            ``state_rounding`` (default ``"stochastic"``, reproducible from
            ``rounding_seed``; or ``"nearest"``) says. ``state_dict()`` holds the BF16
            moments (torch.optim.AdamW widens them when it loads them); an FP32
            checkpoint loads rounded to nearest. Or ``"8bit"``: each moment as blockwise
            8-bit codes with one FP32 scale per block of 256 elements, about 2 bytes of
            state per element for both moments (Note [8-bit moments] in csrc/quant8.h),
            rounded to nearest, for parameters of at least ``min_8bit_size`` elements
            (int, default 4096; smaller ones keep FP32 moments); their state entries hold
            ``exp_avg_codes`` and ``exp_avg_scales`` in place of ``exp_avg`` (and so on),
            an FP32 checkpoint loads quantized, and
            :func:`ruda_torch.dequantize_state_dict` converts ours to torch's format.
            Param-group options.
        hierarchical_stats (bool, default False): before any update, compute one
            12-byte gradient report over all active groups with the native statistics
            kernels; a non-finite gradient skips the step and ``max_grad_norm`` clips
            from it, all on the device. Requires ``fused_step=True``. Optimizer-wide.
        max_grad_norm (float or None, default None): clip the global gradient norm (of
            all active groups) to this value, like ``clip_grad_norm_``, without writing
            the gradients. Optimizer-wide.
        process_group (default None): with FSDP1 (or any plain-tensor parameters that
            are shards across ranks), the process group they are sharded over, so that
            the statistics and clipping use the global norm (docs/fsdp.md). FSDP2,
            HSDP and tensor-parallel DTensor parameters take their groups from the mesh
            (Note [Scopes]); DDP needs none. Optimizer-wide, never stored in the state
            dict. ``deepcopy`` shares it.
        partition_group (default None): the group of ranks that own *different parts*
            of the model: ``ZeroRedundancyOptimizer``'s partitions (it keeps
            ``process_group`` for itself and builds this optimizer on each rank's
            partition) or pipeline stages. Each rank's whole report (or squared norm) is
            summed over it, so the statistics, the skip decision and clipping are global
            over all parts; it may be given together with ``process_group`` or a mesh
            (pipeline stages of an FSDP model) but must share no other rank with them.
            Optimizer-wide, as ``process_group``.

    Migration from ``torch.optim.AdamW``: pass ``eps=1e-8, weight_decay=1e-2`` to keep
    torch's defaults. ``state_dict()`` has torch's format; checkpoints load both ways.

    ``torch.amp.GradScaler`` is supported without unscaling the gradients first
    (``_step_supports_amp_scaling``); a nonzero ``found_inf`` skips the whole step,
    decided on the device. After each step with ``hierarchical_stats``,
    ``last_report`` is a :class:`GradientReport`.

    ``optimizer.state`` and ``param_groups`` are the truth, as in torch: any change to
    them (a load, a reset, a replaced tensor or parameter) is honoured by the next step
    or rejected before anything is written (Note [Fused state coherence]).
    """

    _step_supports_amp_scaling = True

    # torch.optim.AdamW's update is always decoupled; ruda_torch.Adam overrides these.
    _ALWAYS_DECOUPLED = True
    _TORCH_CLASS = "torch.optim.AdamW"

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-5,
        weight_decay: float = 1e-4,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        fused_step: bool | None = None,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
        rounding_seed: int = 0,
        flat_grads: bool = False,
        state_precision: str = "fp32",
        state_rounding: str = "stochastic",
        min_8bit_size: int = 4096,
        hierarchical_stats: bool = False,
        max_grad_norm: float | None = None,
        process_group=None,
        partition_group=None,
    ):
        keywords = dict(lr=lr, betas=betas, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused, fused_step=fused_step)  # fmt: skip
        check_tensor_hypers_with_foreach(keywords, None, "construction")
        check_hyperparameters(lr, betas, eps, weight_decay)
        fused_step = _torch_keywords(keywords, None)
        check_execution_keywords({**keywords, "fused_step": fused_step}, None, "construction")
        if hierarchical_stats and not fused_step:
            raise ValueError(
                "hierarchical_stats=True requires fused_step=True (the statistics feed the "
                "native fused kernel)"
            )
        check_process_group(process_group, "process_group")
        check_process_group(partition_group, "partition_group")
        if process_group is not None and partition_group is not None:
            from .distributed import Scope, check_disjoint

            check_disjoint(Scope((process_group,)), partition_group, "process_group")
        self.hierarchical_stats = bool(hierarchical_stats)
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        self.process_group = process_group
        self.partition_group = partition_group
        self.last_report: GradientReport | None = None
        self._plan: _fused.FusedPlan | None = None
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=bool(capturable),
            differentiable=bool(differentiable),
            fused=fused,
            decoupled_weight_decay=self._decoupled_default(),
            fused_step=fused_step,
            master_weights=master_weights,
            stochastic_rounding=stochastic_rounding,
            rounding_seed=rounding_seed,
            flat_grads=flat_grads,
            state_precision=state_precision,
            state_rounding=state_rounding,
            min_8bit_size=min_8bit_size,
        )
        _fused.check_group_options(defaults, None)
        self._flat_warned = False
        super().__init__(params, defaults)
        self._home_groups = self.param_groups  # Note [Swapped param_groups]
        self._install_flat_grads()  # before the first backward, which then fills the views

    # ------------------------------------------------------------------ pickling
    # torch's Optimizer pickles only defaults, state and param_groups; the options that
    # change the math go with them. The plan is derived again after unpickling.
    def __getstate__(self):
        for name in ("process_group", "partition_group"):
            group = self.__dict__.get(name)
            if group is not None:
                try:
                    ranks = f" (ranks {list(ranks_of(group))})"
                except ValueError:  # destroyed: the refusal stands without its ranks
                    ranks = ""
                raise TypeError(
                    f"{type(self).__name__} with {name}={ranks} cannot "
                    "be pickled (pickle, torch.save(optimizer)): a ProcessGroup is this "
                    "process's handle to its communicators and has no pickled form. Save "
                    "optimizer.state_dict() instead (it records the groups as rank tuples) and "
                    f"load it into an optimizer made with {name}= of the new run; "
                    "copy.deepcopy(optimizer) works (the copy shares the group)"
                )
        return self._copied_state()

    def _copied_state(self) -> dict:
        state = dict(super().__getstate__())
        state.update({k: self.__dict__.get(k, v) for k, v in _OPTIONS.items()})
        return state

    def __setstate__(self, state):
        super().__setstate__(state)  # also called by load_state_dict with state and groups
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("fused_step", self.defaults.get("fused_step", False))
            for k, v in _FUSED_KEYS.items():
                group.setdefault(k, self.defaults.get(k, v))
            for k, v in _TORCH_GROUP_KEYS.items():
                group.setdefault(
                    k, v if k != "decoupled_weight_decay" else self._decoupled_default()
                )
            if self._ALWAYS_DECOUPLED:  # as torch.optim.AdamW: always decoupled
                group["decoupled_weight_decay"] = True
        for k, v in _OPTIONS.items():
            self.__dict__.setdefault(k, v)  # pickles older than these options
        self.__dict__.setdefault("_plan", None)
        self.__dict__.setdefault("_flat_warned", False)
        self._home_groups = self.param_groups  # load_state_dict makes a new list

    def __deepcopy__(self, memo):
        # A process group is a handle to shared communicators: the copy shares it.
        for group in (self.process_group, self.partition_group):
            if group is not None:
                memo.setdefault(id(group), group)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self._copied_state(), memo))
        return new

    def _decoupled_default(self) -> bool:
        return self.__dict__.get("_decoupled", self._ALWAYS_DECOUPLED)

    def add_param_group(self, param_group: dict) -> None:
        param_group = self._wide_keys_of(param_group)
        if any(k in param_group for k in ("fused", "differentiable", "fused_step")):
            group = dict(param_group)
            group["fused_step"] = _torch_keywords(
                {k: group.get(k) for k in ("foreach", "capturable", "differentiable", "fused",
                                           "fused_step")},
                len(self.param_groups),
                default=self.defaults.get("fused_step", False),
            )  # fmt: skip
            if "fused" not in group and self.defaults.get("fused") is not None:
                group["fused"] = group["fused_step"]  # one setting: torch's name follows ours
            param_group = group
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        gi = len(self.param_groups)
        check_torch_keywords(merged, gi, "add")
        check_hyperparameters(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
        _fused.check_group_options(merged, gi)
        if self.hierarchical_stats and not merged["fused_step"]:
            raise ValueError(
                "hierarchical_stats=True requires fused_step=True in every param group"
            )
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch's own error for sets stays torch's
            params = list(params)
        # Checked before the group exists: a rejected group leaves no trace. (name, tensor)
        # pairs are split by torch's add_param_group below.
        if merged["fused_step"]:
            tensors = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]
            for j, p in enumerate(tensors):
                _fused.check_fused_param(p, gi, j, merged, built=False)
                if self.hierarchical_stats and isinstance(p, torch.Tensor):
                    _check_stats_dtype(p.dtype, gi)
        # A parameter listed twice gets torch's warning here (torch's add_param_group) and,
        # on the fused path, an error at the step that would update it twice.
        super().add_param_group({**param_group, "params": params})

    def _wide_keys_of(self, param_group: dict) -> dict:
        """A group dict whose optimizer-wide options (which wrappers such as
        ZeroRedundancyOptimizer copy into every group and sync back and forth) agree with
        this optimizer's, with process groups replaced by the tuple of their ranks: a
        ProcessGroup cannot be pickled, and a group dict goes into ``state_dict()``."""
        if not any(k in param_group for k in _WIDE_KEYS):
            return param_group
        group = dict(param_group)
        for k in ("hierarchical_stats", "max_grad_norm"):
            if k in group:
                value = group[k]
                ours = getattr(self, k)
                if k == "max_grad_norm" and value is not None:
                    value = check_max_grad_norm(value)
                if bool(value) != bool(ours) if k == "hierarchical_stats" else value != ours:
                    raise ValueError(
                        f"a param group sets {k}={group[k]!r}, but {k} is an optimizer-wide "
                        f"option (this optimizer's is {ours!r}): pass it to "
                        f"ruda_torch.{type(self).__name__}(...), not in a param group"
                    )
        for k in _GROUPS_KEYS:
            if k in group:
                group[k] = self._group_description(k, group[k])
        return group

    def _group_description(self, key: str, value):
        """The picklable form of a process group in a group dict (a tuple of ranks)."""
        if value is None or (isinstance(value, tuple) and all(isinstance(r, int) for r in value)):
            return value
        check_process_group(value, key)
        ranks = ranks_of(value, key)
        ours = getattr(self, key)
        if ours is None or ranks_of(ours, key) != ranks:
            raise ValueError(
                f"a param group sets {key} to the group of ranks {list(ranks)}, but {key} "
                f"is an optimizer-wide option (this optimizer's is "
                f"{'None' if ours is None else list(ranks_of(ours, key))}): pass it to "
                f"ruda_torch.{type(self).__name__}(...), not in a param group"
            )
        return ranks

    def state_dict(self) -> dict:
        """torch's ``Optimizer.state_dict``, with any process group that a wrapper put
        into a group dict written as the tuple of its ranks (picklable, loadable with
        ``weights_only=True``).

        8-bit moments are there as their codes and scales (Note [8-bit state entries] in
        _validate.py), except those of parameters that FSDP1 flattened (its flat
        parameters, and the original ones with ``use_orig_params=True``), which are
        there decoded (FP32, torch's keys): FSDP1's optimizer state dicts gather and
        reshape every state tensor of such a parameter like its shards, which per-block
        scales are not. The load codes them again, into the same codes and scales where
        the sharding is the same (the decoded values of a block code back exactly),
        quantized afresh where it is not.
        """
        sd = super().state_dict()
        for g in sd["param_groups"]:
            for k in _GROUPS_KEYS:
                if k in g and g[k] is not None and not isinstance(g[k], tuple):
                    g[k] = ranks_of(g[k], k)
        params = [p for g in self.param_groups for p in g["params"]]
        # FSDP1 marks what it flattens with this attribute (torch's FSDP_FLATTENED).
        flat = {i for i, p in enumerate(params) if getattr(p, "_fsdp_flattened", False)}
        return _fused.dequantize_entries(sd, flat) if flat else sd

    # ------------------------------------------------------------------ checkpoints
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict written by this optimizer or by ``torch.optim.AdamW``.

        Every group option and state entry is checked before anything changes (entries
        in AdamW's layout, shaped like their parameters, step counters that are
        non-negative integers); a rejected load leaves the optimizer as it was. Options
        missing from the checkpoint (``fused_step``) keep their current values. The
        buckets adopt the loaded values (Note [Fused state coherence]).

        torch's load hooks run where torch runs them: the pre-hooks first, on a shallow
        copy, and what they return is what is validated and loaded; the post-hooks last,
        after the buckets adopted the load, so that a state they replace is what the next
        step uses.
        """
        state_dict = state_dict.copy()  # shallow, as torch (the pre-hooks may mutate it)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_hooks = (
            self._optimizer_load_state_dict_pre_hooks,
            self._optimizer_load_state_dict_post_hooks,
        )
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()  # ran above
        self._optimizer_load_state_dict_post_hooks = OrderedDict()  # run below
        try:
            self._load_state_dict(state_dict)
        finally:
            (
                self._optimizer_load_state_dict_pre_hooks,
                self._optimizer_load_state_dict_post_hooks,
            ) = saved_hooks
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(groups)} parameter groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        id_to_param = {}
        new_groups = []
        for gi, (saved, current) in enumerate(zip(groups, self.param_groups, strict=True)):
            if len(saved["params"]) != len(current["params"]):
                raise ValueError(
                    f"loaded param group {gi} has {len(saved['params'])} parameters, this "
                    f"optimizer's has {len(current['params'])}"
                )
            id_to_param.update(zip(saved["params"], current["params"], strict=True))
            g = dict(saved)
            if "fused_step" not in g:
                # torch's checkpoint: the path stays this optimizer's, and torch's `fused`
                # (which names the path) follows it where the two would disagree.
                g["fused_step"] = current["fused_step"]
                if g.get("fused") is not None and bool(g["fused"]) != g["fused_step"]:
                    g["fused"] = current.get("fused")
            for k in _FUSED_KEYS:
                g.setdefault(k, current[k])
            check_torch_keywords(g, gi, "load")
            check_hyperparameters(g["lr"], g["betas"], g["eps"], g["weight_decay"])
            _fused.check_group_options(g, gi)
            if self.hierarchical_stats and not g["fused_step"]:
                raise ValueError(f"loaded param group {gi} has fused_step=False but "
                                 "hierarchical_stats=True requires it")  # fmt: skip
            new_groups.append(g)
        steps = {}  # parameter id -> its validated step counter
        fused = {id(p) for g, current in zip(new_groups, self.param_groups, strict=True)
                 if g["fused_step"] for p in current["params"]}  # fmt: skip
        for key, st in state_dict["state"].items():
            if key not in id_to_param:
                raise ValueError(f"loaded state has an entry for unknown parameter index {key}")
            if st:
                p = id_to_param[key]
                steps[id(p)] = check_state_entry(st, p, f"loaded state[{key}]", id(p) in fused)
        needs_global = self.hierarchical_stats or self.max_grad_norm is not None
        for gi, g in enumerate(new_groups):  # what derive() below checks of the parameters
            if g["fused_step"]:
                _fused.split_group(self, gi, {**g, "params": self.param_groups[gi]["params"]},
                                   needs_global)  # fmt: skip
        # torch's load casts every state tensor to the parameter's dtype, which would
        # round FP32 moments and masters of 16-bit parameters, and turn 8-bit codes and
        # scales into values (at four times their memory): the fused parameters' values
        # go around it, and the buckets adopt them exactly.
        taken = (*STATE_KEYS, *EIGHT_BIT_KEYS, MASTER_KEY)
        loaded = {
            key: {k: v for k, v in st.items() if k not in taken}
            if st and id(id_to_param[key]) in fused
            else st
            for key, st in state_dict["state"].items()
        }
        super().load_state_dict({"state": loaded, "param_groups": new_groups})
        for key, st in state_dict["state"].items():
            p = id_to_param[key]
            if id(p) in fused and st:
                self.state[p].update((k, st[k]) for k in taken if k in st)
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in steps:  # torch's format: an FP32 0-dim tensor per parameter
                    self.state[p]["step"] = torch.tensor(
                        steps[id(p)], dtype=torch.float32, device=local(p).device
                    )
        self._current_plan()  # the buckets adopt the loaded state now; validated above

    # ------------------------------------------------------------------ step
    def step(self, closure=None):
        """Perform one optimization step; returns the closure's loss if one is given.
        All or nothing (Note [Atomic step])."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        return loss

    # Note [Steps under torch.compile]
    # The step is host orchestration around native operators (the plan check and the
    # gradient gathering are C loops, Note [Fused state coherence]) that dynamo cannot
    # trace; traced, each of them broke the graph and every LR change recompiled. Excluded
    # from tracing as a whole, the step costs a compiled region one graph break, reads lr
    # (a float or a Tensor) at run time, never recompiles for a schedule, and gives the
    # bits of an eager step.
    @torch.compiler.disable
    @torch.no_grad()
    def _step(self) -> None:
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)

        # Phase 1: gather and validate everything; nothing is written before phase 2.
        if self.hierarchical_stats or self.max_grad_norm is not None:
            self._check_whole_groups()
        for gi, group in enumerate(self.param_groups):
            check_torch_keywords(group, gi, "step")
            check_hyperparameters(
                group["lr"], group["betas"], group["eps"], group["weight_decay"], read_values=False
            )
            _fused.check_group_options(group, gi)  # as at construction: they may have changed
        plan = self._current_plan()
        for gi, group, buckets in plan.groups:
            _fused.check_bucket_options(group, gi, buckets)
        calls: list[_FusedCall] = []
        fresh: list[tuple[_fused.Bucket, int, bool]] = []  # slots that get state now
        readopt: list[tuple[_fused.Bucket, list[int]]] = []  # flat views to put back
        for gi, group, buckets in plan.groups:
            for b in buckets:
                if b.flat:
                    replaced, unwritten = b.check_grads()
                    b.check_replaced(replaced, gi)  # their views go back after the step
                    if replaced:  # this step takes the gradients where they are
                        readopt.append((b, replaced))
                    else:
                        self._flat_call(b, group, gi, unwritten, calls, fresh)
                        continue
                grads, missing, mixed, relayout = _C.grads_of(b.params)
                if not missing:
                    active = b.all_slots
                else:
                    if missing == len(grads):
                        continue
                    active = [i for i, g in enumerate(grads) if g is not None]
                    grads = [grads[i] for i in active]
                if b.n_with_state != len(b.params):
                    fresh.extend((b, i, group["amsgrad"]) for i in active if b.views[i] is None)
                if b.distributed:
                    grads = [local(g) for g in grads]
                if relayout:
                    grads = [
                        _in_layout(b.targets[i], g) for i, g in zip(active, grads, strict=True)
                    ]
                call = _FusedCall(b, group, active, grads, gi)
                calls.extend(_split_by_dtype(call) if mixed else (call,))
        new_state = bool(fresh)  # phase 2 writes before the first kernel call
        numeric_steps = []  # generic parameters whose step is a number or integer tensor
        generic: list[tuple[dict, list[torch.Tensor], list[torch.Tensor]]] = []
        # The tensor-op norm's scopes on the generic path: (scope, gradient) for each
        # gradient, and the scope of every generic parameter, in order (_stats).
        norm_grads: list = []
        norm_scopes: list = []
        for gi, group in enumerate(self.param_groups):
            if group.get("fused_step"):
                continue
            indexed = [(j, p) for j, p in enumerate(group["params"]) if p.grad is not None]
            params = [p for _, p in indexed]
            grads = [p.grad for p in params]
            _generic.check_generic(gi, indexed, grads)
            if self.max_grad_norm is not None:  # the norm's scopes, checked up front
                for j, p in enumerate(group["params"]):
                    scope = scope_of(p, self.process_group, True,
                                     f"param group {gi} parameter {j}", self.partition_group)  # fmt: skip
                    if scope not in norm_scopes:
                        norm_scopes.append(scope)
                    if p.grad is not None:
                        norm_grads.append((scope, p.grad))
            for j, p in indexed:
                st = self.state.get(p)
                if not st:
                    new_state = True
                elif _generic.check_entry(st, p, group["amsgrad"], f"optimizer.state of "
                                          f"param group {gi} parameter {j}"):  # fmt: skip
                    numeric_steps.append(p)
            if params:
                generic.append((group, params, grads))
        if self.hierarchical_stats and generic:
            raise ValueError(
                "hierarchical_stats=True requires fused_step=True in every param group"
            )
        if any(c.bucket.device.type == "cuda" for c in calls) and (
            torch.cuda.is_current_stream_capturing()
        ):
            self._check_capturable(calls, generic)
        per_device = _stats.PerDevice()
        if self.hierarchical_stats:
            for c in calls:  # raises for a gradient too large for one report
                _check_stats_dtype(c.bucket.dtype, c.gi)
                c.bucket.row_pieces(c.active)
        if len(calls) > 1 or (calls and (new_state or numeric_steps)):
            for c in calls:
                self._run(ops.check_adamw_scaled, c, grad_scale, found_inf, None, None, per_device)

        # Phase 2: state for parameters that are active for the first time.
        for b, i, _ in fresh:
            b.clear_fresh(i)
        made = [b.own_views(i, amsgrad) for b, i, amsgrad in fresh]  # Bucket.own_views
        for (b, i, _), views in zip(fresh, made, strict=True):
            b.install(i, self.state[b.params[i]], views)
        for p in numeric_steps:
            st = self.state[p]
            st["step"] = torch.tensor(
                float(st["step"]), dtype=torch.float32, device=local(p).device
            )
        created = bool(numeric_steps)
        for group, params, _ in generic:
            for p in params:
                if len(self.state[p]) == 0:
                    self.state[p] = _generic.fresh_state(p, group["amsgrad"])
                    created = True
                elif group["amsgrad"] and "max_exp_avg_sq" not in self.state[p]:
                    self.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)
                    created = True
        if fresh or created:
            plan.record(self)

        # Phase 3: statistics or norm, then the updates.
        stats = clip_coef = None
        if self.hierarchical_stats:
            stats = _stats.gradient_report(
                calls, plan.buckets, grad_scale, per_device, self.partition_group
            )
        elif self.max_grad_norm is not None:
            clip_coef = _stats.tensor_norm_clip(
                self.max_grad_norm, calls, (norm_grads, norm_scopes), plan.buckets,
                grad_scale, self.partition_group,
            )  # fmt: skip
        # The kernels read an FP32 coefficient, and FP64 buckets clip_grad_norm_'s FP64 one
        # (tensor_norm_clip makes it FP64 where a gradient is FP64): rounded to FP32 it
        # would clip FP64 gradients by another number than torch.
        clip32 = clip_coef
        if clip_coef is not None and clip_coef.dtype != torch.float32:
            clip32 = clip_coef.to(torch.float32)
        for c in calls:
            clip = clip_coef if c.bucket.dtype == torch.float64 else clip32
            self._run(ops.adamw_scaled_, c, grad_scale, found_inf, stats, clip, per_device)
        for group, params, grads in generic:
            for p, grad in zip(params, grads, strict=True):
                dev = p.device
                _generic.update(
                    p, grad, self.state[p], group,
                    per_device.get(grad_scale, dev), per_device.get(found_inf, dev),
                    per_device.get(clip_coef, dev),
                )  # fmt: skip
        if stats is not None:
            self.last_report = GradientReport(stats, self.max_grad_norm, found_inf)
        self._readopt(plan, readopt)

    # ------------------------------------------------------------------ gradients
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as ``torch.optim.Optimizer.zero_grad``. In a group with
        ``flat_grads`` the gradients stay views of the flat buffer, which is filled with
        zeros in one pass; with ``set_to_none`` a parameter whose view backward does not
        write before the next step counts as having no gradient, and is not stepped
        (docs/usage.md, Note [Flat gradient buckets])."""
        if not any(g.get("fused_step") and g.get("flat_grads") for g in self.param_groups):
            super().zero_grad(set_to_none)  # torch's, exactly
            return
        self._zero_grad_flat(set_to_none)

    # Host orchestration around C loops, like the step (Note [Steps under torch.compile]).
    @torch.compiler.disable
    def _zero_grad_flat(self, set_to_none: bool) -> None:
        flat = set()
        try:
            buckets = self._flat_buckets()
        except (ValueError, RuntimeError):
            # The state or the groups are not valid for a step (the step says why): reset
            # these gradients as torch would, and let the step raise.
            buckets = []
        pending = [(b, b.check_grads()[0]) for b in buckets]
        for b, replaced in pending:  # every refusal before the first write
            b.check_replaced(replaced)
        with torch.no_grad():
            for b, replaced in pending:
                b.zero_grads(set_to_none, replaced)
                flat.update(map(id, b.params))
        foreach = self.defaults.get("foreach", False) or self.defaults.get("fused", False)
        if not hasattr(self, "_zero_grad_profile_name"):
            self._patch_step_function()
        grouped: dict = defaultdict(lambda: defaultdict(list))
        with torch.autograd.profiler.record_function(self._zero_grad_profile_name):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None or id(p) in flat:
                        continue
                    if set_to_none:
                        p.grad = None
                        continue
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    if not foreach or p.grad.is_sparse:
                        p.grad.zero_()
                    else:
                        grouped[p.grad.device][p.grad.dtype].append(p.grad)
            for per_dtype in grouped.values():
                for grads in per_dtype.values():
                    torch._foreach_zero_(grads)

    def _flat_buckets(self) -> list[_fused.Bucket]:
        """The buckets with flat gradients, the plan derived if needed; none while a flat
        group still has meta parameters (the model is not materialized yet)."""
        groups = [g for g in self.param_groups if g.get("fused_step") and g.get("flat_grads")]
        if not groups or any(local(p).is_meta for g in groups for p in g["params"]):
            return []
        return [b for b in self._current_plan().buckets if b.flat]

    def _install_flat_grads(self) -> None:
        with torch.no_grad():
            for b in self._flat_buckets():
                replaced, _ = b.check_grads()
                b.adopt_grads(replaced)

    def _flat_call(self, b, group, gi: int, unwritten: list[int], calls, fresh) -> None:
        """The kernel call of a flat bucket whose views are all in place: every parameter
        whose view was written since zero_grad() (Note [Flat gradient buckets])."""
        if not unwritten:
            active, grads = b.all_slots, b.grad_views
        else:
            skip = set(unwritten)
            active = [i for i in b.all_slots if i not in skip]
            if not active:
                return
            grads = [b.grad_views[i] for i in active]
        if b.n_with_state != len(b.params):
            fresh.extend((b, i, group["amsgrad"]) for i in active if b.views[i] is None)
        calls.append(_FusedCall(b, group, active, grads, gi, flat=True))

    def _readopt(self, plan, readopt) -> None:
        """After a step that found flat views replaced (``model.zero_grad()``, an assigned
        ``p.grad``, DDP with ``gradient_as_bucket_view=True``, backward with
        ``create_graph=True``): the gradients go back into the views, values kept. When
        that happened at two steps in a row, something replaces them every iteration and
        copying them back would only add a pass: the bucket is left with the gradients
        where they are (stepped as with flat_grads=False) until this optimizer's
        zero_grad() puts the views back."""
        replaced_now = {id(b) for b, _ in readopt}
        for b in plan.buckets:
            if b.flat:
                b.replaced_in_a_row = b.replaced_in_a_row + 1 if id(b) in replaced_now else 0
        for b, replaced in readopt:
            if b.replaced_in_a_row < 2:
                b.adopt_grads(replaced)
                continue
            if not self._flat_warned:
                self._flat_warned = True
                warnings.warn(
                    f"ruda_torch.AdamW(flat_grads=True): {len(replaced)} gradient(s) of a "
                    f"bucket on {b.device} were not the flat buffer's views at two steps in a "
                    "row: something replaces the gradients every iteration (model.zero_grad() "
                    "or another optimizer's zero_grad(set_to_none=True), DDP with "
                    "gradient_as_bucket_view=True, backward(create_graph=True)). These "
                    "gradients are stepped where they are, as with flat_grads=False, until "
                    "this optimizer's zero_grad() puts the views back; call it instead of "
                    "model.zero_grad(), or pass flat_grads=False (docs/usage.md).",
                    stacklevel=4,
                )

    # Note [Capturing a step in a CUDA graph]
    # A replayed graph repeats the kernel launches with the arguments they were captured
    # with, and reads every device tensor anew: so what changes between steps must live
    # in device memory. The step counters, GradScaler's scale and found_inf and a Tensor
    # lr do (the kernels read them); a float lr is baked in at capture. The tensor table
    # of a flat-gradient bucket stays at one device address, rewritten only when the set
    # of parameters with a gradient changes (refused during capture), while the gathered
    # path uploads a fresh table per call from reused pinned memory, which a replay would
    # read stale: so a captured step needs flat_grads=True in every fused group. The
    # statistics of a flat bucket keep their tables on the device the same way, so
    # hierarchical_stats (with max_grad_norm: skip and clip decided on the device) is
    # capturable; the tensor-op norm of max_grad_norm alone is not supported under capture.
    # Capture after a few eager steps (the first one creates the state and places the
    # tables), as torch's own capturable optimizers require.
    def _check_capturable(self, calls, generic) -> None:
        def refuse(what: str) -> None:
            raise RuntimeError(
                f"ruda_torch.AdamW.step() is being captured in a CUDA graph, but {what}. A "
                "capturable step needs fused_step=True and flat_grads=True in every group "
                "with CUDA parameters (clipping through hierarchical_stats=True), after at "
                "least one eager step (Note [Capturing a step in a CUDA graph])"
            )

        for c in calls:
            if not c.flat:
                refuse(f"param group {c.gi} steps gathered gradients (flat_grads=False, or "
                       "its gradients were replaced since the last step)")  # fmt: skip
            if c.bucket.n_with_state != len(c.bucket.params):
                refuse(f"param group {c.gi} has parameters without state yet")
        if generic:
            refuse("a group has fused_step=False")
        if self.max_grad_norm is not None and not self.hierarchical_stats:
            refuse("max_grad_norm is set without hierarchical_stats=True (the tensor-op norm)")

    # ------------------------------------------------------------------ internals
    # Note [Swapped param_groups]
    # DeepSpeed's ZeRO 1/2 step assigns `optimizer.param_groups = [groups[i]]` and steps
    # one group at a time, then puts the whole list back. A step of one group is right for
    # the update, but a report (skip decision, clip norm) of one group is not the model's:
    # each group would be clipped by its own norm. The fact checked: the list stepped is a
    # new list holding some, not all, of the groups of the optimizer's own list (the one
    # built by the constructor or a load; changed in place by add_param_group or `del`).
    # The buckets of the groups not stepped stay cached (derive keeps them), so the swap
    # costs a plan check, not a rebuild.
    def _check_whole_groups(self) -> None:
        groups, home = self.param_groups, self._home_groups
        if groups is home or len(groups) >= len(home):
            return
        home_ids = {id(g) for g in home}
        if all(id(g) in home_ids for g in groups):
            what = []
            if self.max_grad_norm is not None:
                what.append(f"max_grad_norm={self.max_grad_norm}")
            if self.hierarchical_stats:
                what.append("hierarchical_stats=True")
            raise ValueError(
                f"optimizer.param_groups holds {len(groups)} of this optimizer's "
                f"{len(home)} param groups for this step (DeepSpeed's ZeRO steps one group at "
                f"a time this way), so {' and '.join(what)} would decide clipping and skipping "
                "from one group's gradients only. Under DeepSpeed, clip with its "
                '"gradient_clipping" config and leave max_grad_norm and hierarchical_stats '
                "unset (or use one param group); to remove groups for good, delete them from "
                "optimizer.param_groups in place"
            )

    def _current_plan(self) -> _fused.FusedPlan:
        """The buckets, derived again when the state or the groups changed (Note [Fused
        state coherence]); raises, writing nothing, when they cannot be."""
        plan = self._plan
        if plan is not None and plan.is_current(self):
            return plan
        # Note [Swapped param_groups]: a plan per recent list of groups, so that DeepSpeed's
        # one-group-at-a-time steps check a plan instead of deriving one at every swap.
        # Only plans of the optimizer's own groups are kept (a plan holds its buckets'
        # memory: one of groups that a load replaced must go).
        home = {id(g) for g in self._home_groups}
        others = {
            k: v for k, v in self.__dict__.get("_other_plans", {}).items() if home.issuperset(k)
        }
        self._other_plans = others
        if plan is not None and home.issuperset(map(id, plan._group_dicts)):
            others[tuple(map(id, plan._group_dicts))] = plan
        key = tuple(map(id, self.param_groups))
        cached = others.pop(key, None)
        if cached is not None and cached.is_current(self):
            self._plan = cached
            return cached
        needs_global = self.hierarchical_stats or self.max_grad_norm is not None
        plan = self._plan = _fused.derive(self, plan, needs_global)
        while len(others) > 4:  # the oldest go
            others.pop(next(iter(others)))
        return plan

    def _run(self, op, c: _FusedCall, grad_scale, found_inf, stats, clip_coef, per_device):
        """One kernel call (``adamw_scaled_``) or its validation (``check_adamw_scaled``)."""
        b, g, dev = c.bucket, c.group, c.bucket.device
        lr = g["lr"]
        if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":  # read by the kernel
            lr = per_device.get(lr, dev)  # (a CPU Tensor lr is read by the binding)
        writes = op is ops.adamw_scaled_
        if writes and b.staged:
            b.stage_in(c.active)
        all_active = len(c.active) == len(b.params)
        if c.flat:
            op = functools.partial(
                ops.flat_step, b.handle(), None if all_active else c.active,
                validate_only=not writes, amsgrad=g["amsgrad"], state_dtype=b.exp_avg.dtype,
            )  # fmt: skip
        else:
            op = functools.partial(
                op,
                b.targets if all_active else [b.targets[i] for i in c.active],
                c.grads,
                b.exp_avg,
                b.exp_avg_sq,
                b.max_exp_avg_sq if g["amsgrad"] else None,
                b.steps,
                b.slots(c.active),
                master=b.master,
                scales=b.scales,
            )
        try:
            op(
                lr=lr,
                beta1=g["betas"][0],
                beta2=g["betas"][1],
                eps=g["eps"],
                weight_decay=g["weight_decay"],
                maximize=g["maximize"],
                grad_scale=per_device.get(grad_scale, dev),
                found_inf=per_device.get(found_inf, dev),
                stats=per_device.get(stats, dev),
                max_grad_norm=self.max_grad_norm
                if stats is not None and self.max_grad_norm
                else 0.0,
                clip_coef=per_device.get(clip_coef, dev),
                stochastic_rounding=bool(g["stochastic_rounding"]) and b.dtype == torch.bfloat16,
                seed=g["rounding_seed"],
                state_rounding=g["state_rounding"],
                decoupled=bool(g.get("decoupled_weight_decay", True)),
            )
        except RuntimeError as e:
            # The operator counts the call's tensors: name the group, and the parameter
            # when the message names one.
            where = f"param group {c.gi}"
            if len(c.active) != len(b.params) or len(b.params) != len(g["params"]):
                where += " (tensor indices below count its parameters with a gradient on "
                where += f"{dev}: group positions {_positions(g, b, c.active)})"
            raise RuntimeError(f"{where}: {e}") from e
        if writes and b.staged:
            b.stage_out(c.active)


def _torch_keywords(kw: dict, gi, default: bool = False) -> bool:
    """The meaning of torch.optim's execution keywords here (docs/usage.md, "torch's
    keywords"); returns fused_step. ``fused=True`` is ``fused_step=True`` (torch's name for
    the fused path); ``foreach`` and ``capturable`` are accepted and kept in the group, as
    torch keeps them. Their conflicts are check_torch_keywords'."""
    where = "" if gi is None else f" (param group {gi})"
    fused, fused_step = kw.get("fused"), kw.get("fused_step")
    if fused is not None and fused_step is not None and bool(fused) != bool(fused_step):
        raise ValueError(
            f"fused={fused} and fused_step={fused_step} disagree{where}: they are one setting "
            "(fused is torch's name for it); give one, or both the same"
        )
    if fused_step is not None:
        return bool(fused_step)
    return bool(fused) if fused is not None else bool(default)


def check_torch_keywords(group: dict, gi, when: str) -> None:
    """What torch.optim.Adam(W) refuses of its execution keywords, refused wherever a group
    is made (``when`` "construction"), added ("add"), loaded ("load") or stepped ("step"),
    before anything is written (docs/usage.md, "torch's keywords"). torch checks them in
    its constructor (ValueError for a Tensor lr or betas, RuntimeError for ``fused``) and
    finds the rest only at its step (RuntimeError): so here a construction raises torch's
    constructor error and every later place the RuntimeError of torch's step, with torch's
    words. ``differentiable=True`` is refused on either path (the generic one too: the step
    updates in place without autograd), and ``fused`` must agree with ``fused_step``."""
    check_tensor_hypers_with_foreach(group, gi, when)
    check_execution_keywords(group, gi, when)


def check_tensor_hypers_with_foreach(group: dict, gi, when: str) -> None:
    """torch's first checks: a Tensor lr or Tensor betas with foreach=True needs
    capturable=True (before the values are checked, as torch orders them)."""
    where = "" if gi is None else f" (param group {gi})"
    foreach, capturable = group.get("foreach"), group.get("capturable")
    late = RuntimeError if when != "construction" else ValueError
    if foreach and not capturable:
        if isinstance(group.get("lr"), torch.Tensor):
            raise late(
                f"lr as a Tensor is not supported for capturable=False and foreach=True{where} "
                "(torch refuses it too): pass foreach=None, or capturable=True, or a float lr"
            )
        betas = group.get("betas")
        if isinstance(betas, (tuple, list)) and len(betas) == 2:
            for i, beta in enumerate(betas):
                if isinstance(beta, torch.Tensor) and isinstance(betas[1 - i], torch.Tensor):
                    raise ValueError(
                        f"betas[{i}] as a Tensor is not supported for capturable=False and "
                        f"foreach=True{where} (and ruda_torch takes float betas only)"
                    )


def check_execution_keywords(group: dict, gi, when: str) -> None:
    """differentiable, fused with foreach, fused against fused_step (torch checks the first
    two after the values)."""
    where = "" if gi is None else f" (param group {gi})"
    foreach = group.get("foreach")
    fused, fused_step = group.get("fused"), group.get("fused_step")
    on_fused_path = bool(fused) or bool(fused_step)
    if group.get("differentiable"):
        if on_fused_path:
            raise RuntimeError(
                f"`fused` does not support `differentiable`{where}: differentiable=True is not "
                "supported by the fused step (nor by torch's); use torch.optim for a "
                "differentiable optimizer step"
            )
        raise ValueError(
            f"differentiable=True is not supported{where}: ruda_torch's step updates the "
            "parameters in place without autograd (as torch's fused path, which refuses it "
            "too); use torch.optim for a differentiable optimizer step"
        )
    if fused and foreach:
        raise RuntimeError(
            f"`fused` and `foreach` cannot be `True` together{where} (torch's rule): fused=True "
            "is the fused step (fused_step=True); set foreach=None"
        )
    if fused is not None and fused_step is not None and bool(fused) != bool(fused_step):
        changed = " (one of them was changed since)" if when == "step" else ""
        raise ValueError(
            f"fused={fused} and fused_step={fused_step} disagree{where}{changed}: they are one "
            "setting (fused is torch's name for it); set both to the same value to choose "
            "the path"
        )


def _in_layout(target: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g``, or a copy of it laid out in memory as the kernel steps ``target`` (Note
    [Dense layouts] in csrc/bindings.cpp): the gradient of a dense parameter with other
    strides, or a non-contiguous one for a staged parameter. Autograd's gradients need
    none. A gradient of another shape or a sparse one is left for the binding's error."""
    if g.shape != target.shape or g.layout != torch.strided:
        return g
    if not target.is_contiguous() and _fused.is_dense(target):
        if _fused.is_dense(g) and all(
            n <= 1 or a == b
            for n, a, b in zip(target.shape, target.stride(), g.stride(), strict=True)
        ):
            return g
        return torch.empty_like(target, dtype=g.dtype).copy_(g)
    return g if g.is_contiguous() else g.contiguous()


def _check_stats_dtype(dtype: torch.dtype, gi: int) -> None:
    if dtype == torch.float64:
        raise ValueError(
            f"hierarchical_stats=True reads FP32, FP16 and BF16 gradients; param group {gi} "
            "has float64 parameters (FP64 gradients). Use max_grad_norm without "
            "hierarchical_stats for FP64 models"
        )


def _positions(group: dict, b: _fused.Bucket, active: list[int]) -> str:
    index = {id(p): j for j, p in enumerate(group["params"])}
    pos = [index[id(b.params[i])] for i in active]
    return str(pos) if len(pos) <= 8 else f"[{', '.join(map(str, pos[:8]))}, ...]"


def _split_by_dtype(call: _FusedCall) -> list[_FusedCall]:
    """One kernel call takes one gradient dtype: split a bucket's active parameters by
    the dtype of their gradients (normally a single dtype, and no split)."""
    dtypes = set(map(_dtype_of, call.grads))
    parts = []
    for dtype in sorted(dtypes, key=str):
        keep = [k for k, g in enumerate(call.grads) if g.dtype == dtype]
        parts.append(
            _FusedCall(
                call.bucket,
                call.group,
                [call.active[k] for k in keep],
                [call.grads[k] for k in keep],
                call.gi,
            )
        )
    return parts


_dtype_of = operator.attrgetter("dtype")


class Adam(AdamW):
    r"""Adam / AMSGrad with L2 weight decay, as ``torch.optim.Adam``: a drop-in with every
    option of :class:`AdamW` (the fused kernels, buckets, flat gradients, master weights,
    statistics, clipping, GradScaler, checkpoints in torch's format).

    The update is AdamW's with :math:`\lambda` moved from the parameter to the gradient:

    .. math::
        g &= \text{grad} \cdot c / s \; (\text{negated if maximize}) + \lambda p \\
        p &= p - \gamma \frac{m / (1 - \beta_1^t)}{\sqrt{\hat v / (1 - \beta_2^t)} + \epsilon}

    so, as in torch, the decay goes through the moments (Note [Weight decay modes] in
    csrc/adamw_math.h). ``decoupled_weight_decay=True`` makes it AdamW, exactly
    :class:`AdamW` (torch.optim.Adam's own switch). Defaults: ``lr=1e-3``,
    ``betas=(0.9, 0.999)``, ``eps=1e-5`` (**torch's is 1e-8**, as for AdamW: pass
    ``eps=1e-8`` to keep torch's), ``weight_decay=0`` (torch's). Every keyword of
    ``torch.optim.Adam`` is accepted with the meaning documented for AdamW
    (docs/usage.md); a ``torch.optim.Adam`` checkpoint loads here and ours loads there.
    """

    _ALWAYS_DECOUPLED = False
    _TORCH_CLASS = "torch.optim.Adam"

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-5,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        **options,
    ):
        self._decoupled = bool(decoupled_weight_decay)
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
            capturable=capturable, differentiable=differentiable, fused=fused, **options,
        )  # fmt: skip
