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
from collections import OrderedDict, defaultdict

import torch
from torch.optim import Optimizer

from . import _fused, _options, _plan, _state8bit
from . import _step as phases
from ._common import CODED_KEYS, MASTER_KEYS, STATE_KEYS, entry_names, entry_where, local
from ._validate import check_max_grad_norm, check_state_entry, check_stats_dtype
from .distributed import Scope, check_disjoint, check_process_group, ranks_of, scope_of
from .report import GradientReport

__all__ = ["Adam", "AdamW", "GradientReport"]


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
        master_weights (bool or ``"remainder"``, default False): for FP16/BF16 parameters
            of a fused group, ``True`` keeps an FP32 master copy
            (``state[p]["master_param"]``) that the kernel updates, writing the parameter
            rounded to nearest even from it in the same pass (Note [Master weights]);
            ``"remainder"`` (BF16 parameters only) keeps the same FP32 master in 2 bytes:
            its low 16 bits (``state[p]["master_remainder"]``, int16) beside the BF16
            parameter, which holds its high 16 bits rounded (Note [Remainder master] in
            csrc/adamw_math.h). A param-group option; any other value is a ValueError.
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
            8-bit codes with one FP32 scale per block of up to 256 elements of a row
            (rows along the first dimension, the same blocks on every mesh), about 2 bytes of
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
        master_weights: bool | str = False,
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
        fused_step = _options.torch_keywords(dict(fused=fused, fused_step=fused_step), None)
        defaults = dict(
            lr=lr,
            betas=betas,
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
        _options.check_group(defaults, None, "construction", bool(hierarchical_stats))
        defaults["betas"] = tuple(betas)
        check_process_group(process_group, "process_group")
        self.hierarchical_stats = bool(hierarchical_stats)
        self.process_group = process_group
        self.max_grad_norm = max_grad_norm  # checked by the setters below
        self.partition_group = partition_group
        self.last_report: GradientReport | None = None
        self._plan: _plan.FusedPlan | None = None
        self._flat_warned = False
        super().__init__(params, defaults)
        self._home_groups = self.param_groups  # Note [Swapped param_groups]
        self._install_flat_grads()  # before the first backward, which then fills the views

    # ------------------------------------------------------------------ wide options
    # max_grad_norm and partition_group are read by every step: set between steps (as
    # torchtitan's clip call hands them over: ruda_torch/integrations/torchtitan.py), they
    # are checked as at construction, before the next step, and take effect there.
    @property
    def max_grad_norm(self):
        return self.__dict__.get("max_grad_norm")

    @max_grad_norm.setter
    def max_grad_norm(self, value) -> None:
        self.__dict__["max_grad_norm"] = check_max_grad_norm(value)

    @property
    def partition_group(self):
        return self.__dict__.get("partition_group")

    @partition_group.setter
    def partition_group(self, group) -> None:
        check_process_group(group, "partition_group")
        process_group = self.__dict__.get("process_group")
        if group is not None and process_group is not None:
            check_disjoint(Scope((process_group,)), group, "process_group")
        if group is not None:  # the fused parameters' scopes, as the plan checks them
            for gi, g in enumerate(self.__dict__.get("param_groups", ())):
                for j, p in enumerate(g["params"] if g.get("fused_step") else ()):
                    scope_of(p, process_group, True, f"param group {gi} parameter {j}", group)
        self.__dict__["partition_group"] = group

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
        state.update({k: self.__dict__.get(k, v) for k, v in _options.OPTIONS.items()})
        return state

    def __setstate__(self, state):
        super().__setstate__(state)  # also called by load_state_dict with state and groups
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("fused_step", self.defaults.get("fused_step", False))
            for k, v in _options.FUSED_KEYS.items():
                group.setdefault(k, self.defaults.get(k, v))
            for k, v in _options.TORCH_GROUP_KEYS.items():
                group.setdefault(
                    k, v if k != "decoupled_weight_decay" else self._decoupled_default()
                )
            if self._ALWAYS_DECOUPLED:  # as torch.optim.AdamW: always decoupled
                group["decoupled_weight_decay"] = True
        for k, v in _options.OPTIONS.items():
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
        param_group = _options.wide_keys_of(self, param_group)
        if any(k in param_group for k in ("fused", "fused_step")):
            group = dict(param_group)
            group["fused_step"] = _options.torch_keywords(
                group, len(self.param_groups), default=self.defaults.get("fused_step", False)
            )
            if "fused" not in group and self.defaults.get("fused") is not None:
                group["fused"] = group["fused_step"]  # one setting: torch's name follows ours
            param_group = group
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        gi = len(self.param_groups)
        _options.check_group(merged, gi, "add", self.hierarchical_stats)
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
                _options.check_fused_param(p, gi, j, merged, built=False)
                if self.hierarchical_stats and isinstance(p, torch.Tensor):
                    check_stats_dtype(p.dtype, gi)
        # A parameter listed twice gets torch's warning here (torch's add_param_group) and,
        # on the fused path, an error at the step that would update it twice.
        super().add_param_group({**param_group, "params": params})

    def state_dict(self) -> dict:
        """torch's ``Optimizer.state_dict``, with any process group that a wrapper put
        into a group dict written as the tuple of its ranks (picklable, loadable with
        ``weights_only=True``).

        8-bit moments are there as their codes and scales (Note [8-bit state entries] in
        ruda_torch/_state8bit.py), except those of parameters that FSDP1 flattened (its flat
        parameters, and the original ones with ``use_orig_params=True``), which are
        there decoded (FP32, torch's keys): FSDP1's optimizer state dicts gather and
        reshape every state tensor of such a parameter like its shards, which per-block
        scales are not. The load codes them again, into the same codes and scales where
        the sharding is the same (the decoded values of a block code back exactly),
        quantized afresh where it is not.
        """
        sd = super().state_dict()
        for g in sd["param_groups"]:
            for k in _options.GROUPS_KEYS:
                if k in g and g[k] is not None and not isinstance(g[k], tuple):
                    g[k] = ranks_of(g[k], k)
        params = [p for g in self.param_groups for p in g["params"]]
        # FSDP1 marks what it flattens with this attribute (torch's FSDP_FLATTENED).
        flat = {i for i, p in enumerate(params) if getattr(p, "_fsdp_flattened", False)}
        return _state8bit.dequantize_entries(sd, flat) if flat else sd

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
            # Options the checkpoint does not hold (torch's, or a template matched to it:
            # Note [Checkpoint templates] in ruda_torch/_checkpoint.py) are this optimizer's.
            for k, v in current.items():
                if k != "params":
                    g.setdefault(k, v)
            _options.check_group(g, gi, "load", self.hierarchical_stats)
            new_groups.append(g)
        steps = {}  # parameter id -> its validated step counter
        fused = {id(p) for g, current in zip(new_groups, self.param_groups, strict=True)
                 if g["fused_step"] for p in current["params"]}  # fmt: skip
        names = entry_names(groups)
        for key, st in state_dict["state"].items():
            if key not in id_to_param:
                raise ValueError(f"loaded state has an entry for unknown parameter index {key}")
            if st:
                p = id_to_param[key]
                where = entry_where("loaded state", key, names)
                steps[id(p)] = check_state_entry(st, p, where, id(p) in fused)
        needs_global = self.hierarchical_stats or self.max_grad_norm is not None
        for gi, g in enumerate(new_groups):  # what derive() below checks of the parameters
            if g["fused_step"]:
                _plan.split_group(self, gi, {**g, "params": self.param_groups[gi]["params"]},
                                   needs_global)  # fmt: skip
        # torch's load casts every state tensor to the parameter's dtype, which would
        # round FP32 moments and masters of 16-bit parameters, and turn 8-bit codes and
        # scales into values (at four times their memory): the fused parameters' values
        # go around it, and the buckets adopt them exactly.
        taken = (*STATE_KEYS, *CODED_KEYS, *MASTER_KEYS)
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
        work = phases.gather(self, grad_scale, found_inf)  # validates; writes nothing
        phases.create_state(self, work)  # state of parameters active for the first time
        phases.apply(self, work, grad_scale, found_inf)  # statistics or norm, then updates

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
    # (ruda_torch/_step.py's check_whole_groups refuses what it must.)

    def _current_plan(self) -> _plan.FusedPlan:
        """The buckets, derived again when the state or the groups changed (Note [Fused
        state coherence] in ruda_torch/_plan.py); raises, writing nothing, when they
        cannot be."""
        return _plan.current_plan(self)


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
