"""``ruda_torch.AdamW``: a drop-in ``torch.optim.AdamW`` whose fused path runs one native
in-place kernel per bucket, with optional device-side gradient statistics.

Note [Buckets]
With ``fused_step=True`` the parameters of one param group on one device form a bucket:
flat FP32 buffers ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with AMSGrad) in
which every parameter owns a contiguous slice (starting on a 64-byte boundary, so the
kernels use wide accesses), and a flat FP32 ``steps`` buffer with one counter per
parameter. ``optimizer.state[p]`` holds views into these buffers, shaped like ``p``, so
``state_dict()`` has exactly torch.optim.AdamW's format while one kernel launch updates
the whole bucket. A bucket is built on the first fused step of its group, and rebuilt
after ``load_state_dict`` or when the group's parameter list changes; buffers are not
reallocated in the steady state.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from itertools import repeat

import torch
from torch.optim import Optimizer

from . import ops
from ._build import STATS_CHUNK, check_device
from ._validate import check_hyperparameters
from .distributed import LOCAL, globalize_report, globalize_sum, scope_of
from .stats_plan import MAX_ROWS, StatsPlan

__all__ = ["AdamW", "GradientReport"]

_ALIGN = 16  # elements: 64-byte aligned slices
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# torch.optim.AdamW's execution options: kept in every group so that state_dict() has
# torch's exact format, and ignored by this optimizer.
_TORCH_GROUP_KEYS = dict(
    foreach=None, capturable=False, differentiable=False, fused=None, decoupled_weight_decay=True
)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or the tensor itself (fast for plain tensors)."""
    if type(t) in _PLAIN_TYPES:
        return t
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


class GradientReport:
    """The gradient statistics of one step, as device tensors (Note [Statistics row]).

    ``tensor`` holds ``[sum_of_squares, max_abs, nonfinite_count]`` of the unscaled
    gradients of every active parameter. The other attributes are 0-dim tensors computed
    on the device when first read; nothing here forces a host sync until you call
    ``.item()`` (or print) on one of them.
    """

    def __init__(self, tensor: torch.Tensor, max_grad_norm, found_inf):
        self.tensor = tensor
        self._max_grad_norm = max_grad_norm
        self._found_inf = found_inf

    @property
    def grad_norm(self) -> torch.Tensor:
        return self.tensor[0].sqrt()

    @property
    def max_abs(self) -> torch.Tensor:
        return self.tensor[1]

    @property
    def nonfinite_count(self) -> torch.Tensor:
        return self.tensor[2]

    @property
    def clip_coef(self) -> torch.Tensor:
        """``min(1, max_grad_norm / (norm + 1e-6))``, or 1 without ``max_grad_norm``."""
        if self._max_grad_norm is None:
            return torch.ones((), dtype=torch.float32, device=self.tensor.device)
        norm = self.grad_norm
        # A true division, as in the kernel (a Python scalar over a tensor would multiply by
        # a reciprocal instead).
        return (torch.full_like(norm, self._max_grad_norm) / (norm + 1e-6)).clamp(max=1.0)

    @property
    def skipped(self) -> torch.Tensor:
        """True when the step was skipped (non-finite gradient or GradScaler's found_inf)."""
        skipped = self.tensor[2] != 0
        if self._found_inf is not None:
            skipped = skipped | (self._found_inf.reshape(()) != 0)
        return skipped

    def __repr__(self) -> str:
        return f"GradientReport(tensor={self.tensor})"


class _Bucket:
    """Flat state of one (param group, device); see Note [Buckets]."""

    def __init__(self, params: list[torch.Tensor], amsgrad: bool, state: dict, scope=LOCAL):
        self.params = params
        self.scope = scope  # Note [Scopes] in ruda_torch/distributed.py
        # DTensor parameters are stepped on their local shards (Note [Buckets]).
        self.distributed = any(hasattr(p, "device_mesh") for p in params)
        self.locals = [_local(p) for p in params] if self.distributed else params
        self.device = self.locals[0].device if params else torch.device("cpu")
        offsets, total = [], 0
        for t in self.locals:
            offsets.append(total)
            total += -(-t.numel() // _ALIGN) * _ALIGN
        self.offsets = offsets
        opts = dict(dtype=torch.float32, device=self.device)
        self.exp_avg = torch.zeros(total, **opts)
        self.exp_avg_sq = torch.zeros(total, **opts)
        self.max_exp_avg_sq = torch.zeros(total, **opts) if amsgrad else None
        self.steps = torch.zeros(len(params), **opts)
        self.slots_all = torch.tensor(
            [[off, i] for i, off in enumerate(offsets)], dtype=torch.int64
        ).reshape(-1, 2)
        self.has_state = [False] * len(params)
        self.all_slots = list(range(len(params)))
        self._slots_cache: tuple | None = None
        self._pieces_cache: tuple | None = None
        self.n_rows_all = sum(ops.stats_rows_for(t.numel()) for t in self.locals)
        self.rows = None  # statistics buffers, allocated on first use
        self.scratch = None
        for i, p in enumerate(params):
            if p in state:
                self.adopt(i, state[p])
                state[p] = self.state_views(i, p)
                self.has_state[i] = True

    @property
    def fully_initialized(self) -> bool:
        return all(self.has_state)

    def _slice(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        n = self.locals[i].numel()
        return buf[self.offsets[i] : self.offsets[i] + n].view(self.locals[i].shape)

    def adopt(self, i: int, st: dict) -> None:
        """Copy an existing state entry (e.g. loaded from a checkpoint) into slot i."""
        step = st.get("step", 0)
        self.steps[i : i + 1].copy_(torch.as_tensor(step, dtype=torch.float32).reshape(1))
        for key in _STATE_KEYS:
            buf = getattr(self, key)
            if buf is not None and key in st:
                self._slice(buf, i).copy_(_local(st[key]))

    def state_views(self, i: int, p: torch.Tensor) -> dict:
        views = {"step": self.steps[i]}
        for key in _STATE_KEYS:
            buf = getattr(self, key)
            if buf is not None:
                views[key] = _wrap_like(self._slice(buf, i), p)
        return views

    def slots(self, active: list[int]) -> torch.Tensor:
        if len(active) == len(self.params):
            return self.slots_all
        key = tuple(active)
        if self._slots_cache is None or self._slots_cache[0] != key:
            self._slots_cache = (key, self.slots_all[list(active)].contiguous())
        return self._slots_cache[1]

    def row_pieces(self, active: list[int]) -> list[tuple[int, int, int]]:
        """_row_pieces() of the active parameters, cached like slots()."""
        key = None if len(active) == len(self.params) else tuple(active)
        if self._pieces_cache is None or self._pieces_cache[0] != key:
            numels = [self.locals[i].numel() for i in active]
            self._pieces_cache = (key, _row_pieces(numels))
        return self._pieces_cache[1]

    def stats_buffers(self):
        if self.rows is None:
            self.rows = torch.empty((self.n_rows_all, 3), dtype=torch.float32, device=self.device)
            plan = StatsPlan(max(1, min(self.n_rows_all, MAX_ROWS)))
            self.scratch = torch.empty(
                max(plan.scratch_elements, 1), dtype=torch.float32, device=self.device
            )
        return self.rows, self.scratch


def _wrap_like(local_view: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """State for a DTensor parameter is a DTensor with the parameter's mesh and
    placements around the local slice; for a plain tensor it is the slice itself."""
    if not hasattr(p, "device_mesh"):
        return local_view
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local_view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


@dataclass
class _FusedWork:
    bucket: _Bucket
    group: dict
    active: list[int]
    grads: list[torch.Tensor]
    gi: int  # index of the param group, for messages


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
            buckets (Note [Buckets]); a param-group option. Requires FP32 parameters.
            ``False`` is the generic tensor-operation path that works anywhere.
        hierarchical_stats (bool, default False): before any update, compute one
            12-byte gradient report over all active groups with the native statistics
            kernels; a non-finite gradient skips the step and ``max_grad_norm`` clips
            from it, all on the device. Requires ``fused_step=True``. Optimizer-wide.
        max_grad_norm (float or None, default None): clip the global gradient norm (of
            all active groups) to this value, like ``clip_grad_norm_``, without writing
            the gradients. Optimizer-wide.
        process_group (default None): with FSDP1 (or any plain-tensor parameters that
            are shards across ranks), the process group they are sharded over, so that
            the statistics and clipping use the global norm (docs/fsdp.md). FSDP2
            DTensor parameters take their groups from the mesh; DDP needs none.
            Optimizer-wide, never stored in the state dict.

    Migration from ``torch.optim.AdamW``: pass ``eps=1e-8, weight_decay=1e-2`` to keep
    torch's defaults. ``state_dict()`` has torch's format; checkpoints load both ways.

    ``torch.amp.GradScaler`` is supported without unscaling the gradients first
    (``_step_supports_amp_scaling``); a nonzero ``found_inf`` skips the whole step,
    decided on the device. After each step with ``hierarchical_stats``,
    ``last_report`` is a :class:`GradientReport`.
    """

    _step_supports_amp_scaling = True

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
        fused_step: bool = False,
        hierarchical_stats: bool = False,
        max_grad_norm: float | None = None,
        process_group=None,
    ):
        check_hyperparameters(lr, betas, eps, weight_decay)
        if hierarchical_stats and not fused_step:
            raise ValueError(
                "hierarchical_stats=True requires fused_step=True (the statistics feed the "
                "native fused kernel)"
            )
        if max_grad_norm is not None:
            if isinstance(max_grad_norm, bool) or not (
                isinstance(max_grad_norm, (int, float))
                and math.isfinite(max_grad_norm)
                and max_grad_norm > 0
            ):
                raise ValueError(
                    f"Invalid max_grad_norm: {max_grad_norm} (must be a positive float)"
                )
            max_grad_norm = float(max_grad_norm)
        self.hierarchical_stats = bool(hierarchical_stats)
        self.max_grad_norm = max_grad_norm
        self.process_group = process_group
        self.last_report: GradientReport | None = None
        self._buckets: dict = {}
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            **_TORCH_GROUP_KEYS,
            fused_step=fused_step,
        )
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("fused_step", self.defaults.get("fused_step", False))
            for k, v in _TORCH_GROUP_KEYS.items():
                group.setdefault(k, v)
        self.__dict__.setdefault("hierarchical_stats", False)
        self.__dict__.setdefault("max_grad_norm", None)
        self.__dict__.setdefault("process_group", None)
        self.__dict__.setdefault("last_report", None)
        self.__dict__["_buckets"] = {}

    def __getstate__(self):
        state = super().__getstate__()
        state = dict(state)
        state.pop("_buckets", None)
        return state

    def add_param_group(self, param_group: dict) -> None:
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        check_hyperparameters(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
        if self.hierarchical_stats and not merged["fused_step"]:
            raise ValueError(
                "hierarchical_stats=True requires fused_step=True in every param group"
            )
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch's own error for sets stays torch's
            params = list(params)
        if merged[
            "fused_step"
        ]:  # checked before the group exists: a rejected group leaves no trace
            for j, p in enumerate(params):
                _check_fused_param(p, len(self.param_groups), j)
        super().add_param_group({**param_group, "params": params})

    # ------------------------------------------------------------------ checkpoints
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict written by this optimizer or by ``torch.optim.AdamW``.

        Every state tensor is checked against its parameter (shape, floating dtype)
        before anything changes; a rejected load leaves the optimizer as it was.
        Options missing from the checkpoint (``fused_step``) keep their current values.
        """
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
            g.setdefault("fused_step", current["fused_step"])
            check_hyperparameters(g["lr"], g["betas"], g["eps"], g["weight_decay"])
            if self.hierarchical_stats and not g["fused_step"]:
                raise ValueError(f"loaded param group {gi} has fused_step=False but "
                                 "hierarchical_stats=True requires it")  # fmt: skip
            new_groups.append(g)
        for key, st in state_dict["state"].items():
            if key not in id_to_param:
                raise ValueError(f"loaded state has an entry for unknown parameter index {key}")
            p = id_to_param[key]
            for name, value in st.items():
                if name == "step":
                    if isinstance(value, torch.Tensor) and value.numel() != 1:
                        raise ValueError(f"state[{key}]['step'] must hold one value")
                    continue
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"state[{key}][{name!r}] must be a tensor, got {type(value)}")
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(
                        f"state[{key}][{name!r}] has shape {tuple(value.shape)} but its parameter "
                        f"has shape {tuple(p.shape)}"
                    )
                if not (value.is_floating_point() or value.is_complex()):
                    raise ValueError(f"state[{key}][{name!r}] must be floating, got {value.dtype}")
        super().load_state_dict({"state": state_dict["state"], "param_groups": new_groups})
        self._buckets.clear()
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and "step" in st:
                    step = st["step"]
                    st["step"] = torch.as_tensor(step, dtype=torch.float32).to(
                        _local(p).device
                    ).reshape(())  # fmt: skip
        for gi, group in enumerate(self.param_groups):
            if group["fused_step"]:
                self._group_buckets(gi, group)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; returns the closure's loss if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)

        # Phase 1: gather and validate everything; nothing is written before phase 2.
        fused: list[_FusedWork] = []
        generic: list[tuple[dict, list[torch.Tensor], list[torch.Tensor]]] = []
        scopes: list = []  # of the generic path's gradients, in order (tensor-op norm only)
        for gi, group in enumerate(self.param_groups):
            check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            if group["fused_step"]:
                for bucket in self._group_buckets(gi, group):
                    grads = [p.grad for p in bucket.params]
                    if all(map(operator.is_not, grads, repeat(None))):
                        active = bucket.all_slots
                    else:
                        active = [i for i, g in enumerate(grads) if g is not None]
                        if not active:
                            continue
                        grads = [grads[i] for i in active]
                    if fused:
                        _check_grads(grads, gi)
                    fused.extend(_split_by_dtype(_FusedWork(bucket, group, active, grads, gi)))
            else:
                indexed = [(j, p) for j, p in enumerate(group["params"]) if p.grad is not None]
                params = [p for _, p in indexed]
                grads = [p.grad for p in params]
                _check_grads(grads, gi, fused=False)
                if self.max_grad_norm is not None:  # the norm's scope, checked up front
                    for j, p in indexed:
                        scopes.append(
                            scope_of(p, self.process_group, True, f"param group {gi} parameter {j}")
                        )
                if params:
                    generic.append((group, params, grads))
        # The first kernel call validates its own arguments before it writes, so its
        # gradients need no check here unless something is written before it: new state
        # (phase 2), or a split of its bucket into several calls.
        if fused and (
            generic
            or (len(fused) > 1 and fused[1].bucket is fused[0].bucket)
            or not all(w.bucket.fully_initialized for w in fused)
        ):
            _check_grads(fused[0].grads, fused[0].gi)
        if self.hierarchical_stats and generic:
            raise ValueError(
                "hierarchical_stats=True requires fused_step=True in every param group"
            )

        # Phase 2: state for parameters that are active for the first time.
        for work in fused:
            b = work.bucket
            for i in work.active:
                if not b.has_state[i]:
                    self.state[b.params[i]] = b.state_views(i, b.params[i])
                    b.has_state[i] = True
            if b.distributed:
                work.grads = [_local(g) for g in work.grads]
        for group, params, _ in generic:
            for p in params:
                if len(self.state[p]) == 0:
                    self.state[p] = _fresh_state(p, group["amsgrad"])
                elif group["amsgrad"] and "max_exp_avg_sq" not in self.state[p]:
                    self.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)

        # Phase 3: statistics or norm, then the updates.
        stats = clip_coef = None
        per_device = _PerDevice()
        if self.hierarchical_stats:
            stats = self._gradient_report(fused, grad_scale, per_device)
            self.last_report = GradientReport(stats, self.max_grad_norm, found_inf)
        elif self.max_grad_norm is not None:
            clip_coef = self._tensor_norm_clip(fused, generic, scopes, grad_scale)
        for work in fused:
            dev = work.bucket.device
            g = work.group
            b = work.bucket
            ops.adamw_scaled_(
                b.locals
                if len(work.active) == len(b.params)
                else [b.locals[i] for i in work.active],
                work.grads,
                b.exp_avg,
                b.exp_avg_sq,
                b.max_exp_avg_sq if g["amsgrad"] else None,
                b.steps,
                b.slots(work.active),
                lr=g["lr"],
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
            )
        for group, params, grads in generic:
            for p, grad in zip(params, grads, strict=True):
                dev = p.device
                _generic_update(
                    p, grad, self.state[p], group,
                    per_device.get(grad_scale, dev), per_device.get(found_inf, dev),
                    per_device.get(clip_coef, dev),
                )  # fmt: skip
        return loss

    # ------------------------------------------------------------------ internals
    def _all_buckets(self):
        for entry in self._buckets.values():
            yield from entry[2]

    def _group_buckets(self, gi: int, group: dict) -> list[_Bucket]:
        """The buckets of a fused group, (re)built when its parameter list changed."""
        params = group["params"]
        entry = self._buckets.get(gi)
        if (
            entry is not None
            and entry[0] is params
            and entry[1] == len(params)
            and all(b.max_exp_avg_sq is not None or not group["amsgrad"] for b in entry[2])
        ):
            return entry[2]
        for j, p in enumerate(params):
            _check_fused_param(p, gi, j)
        needs_global = self.hierarchical_stats or self.max_grad_norm is not None
        by_device: dict = {}
        scopes: dict = {}
        for j, p in enumerate(params):
            dev = _local(p).device
            scope = scope_of(p, self.process_group, needs_global, f"param group {gi} parameter {j}")
            if dev in scopes and scopes[dev][0] != scope:
                first = scopes[dev][1]
                raise ValueError(
                    f"param group {gi} mixes parameters sharded over different process groups "
                    f"on {dev}: parameter {first} over {scopes[dev][0].describe()}, parameter "
                    f"{j} over {scope.describe()}; put them in separate param groups"
                )
            scopes.setdefault(dev, (scope, j))
            by_device.setdefault(dev, []).append(p)
        buckets = [
            _Bucket(ps, bool(group["amsgrad"]), self.state, scopes[dev][0])
            for dev, ps in by_device.items()
        ]
        self._buckets[gi] = (params, len(params), buckets)
        return buckets

    def _gradient_report(self, fused: list[_FusedWork], grad_scale, per_device) -> torch.Tensor:
        """One report over all active fused buckets: per bucket analyze + merge tree
        (split into several reports when a bucket has more than MAX_ROWS rows); a left
        fold per (device, scope), globalized over the scope's process groups (Note
        [Scopes]); then a left fold across scopes and devices."""
        reports_by_device: dict = {}
        for work in fused:
            b = work.bucket
            rows, scratch = b.stats_buffers()
            pieces = b.row_pieces(work.active)
            out = reports_by_device.setdefault((b.device, b.scope), [])
            row_start = 0
            for lo, hi, n_rows in pieces:
                report = torch.empty(3, dtype=torch.float32, device=b.device)
                piece_rows = rows[row_start : row_start + n_rows]
                ops.analyze_gradient(
                    work.grads[lo:hi], piece_rows, per_device.get(grad_scale, b.device)
                )
                StatsPlan(n_rows).reduce(piece_rows, scratch, report)
                row_start += n_rows
                out.append(report)
        # Every rank takes part in the same all-gathers in the same order, active
        # gradients or not: keys in bucket order, and every sharded scope present.
        order = []
        for b in self._all_buckets():
            key = (b.device, b.scope)
            if key not in order and (b.scope.groups or key in reports_by_device):
                order.append(key)
        if not order:
            return torch.zeros(3, dtype=torch.float32, device=torch.device("cpu"))
        partial = []
        for dev, scope in order:
            reports = reports_by_device.get((dev, scope), [])
            final = torch.empty(3, dtype=torch.float32, device=dev)
            if reports:
                ops.merge_gradient_stats_chunks(torch.stack(reports), final)
            else:
                final.zero_()
            partial.append(globalize_report(final, scope))
        if len(partial) == 1:
            return partial[0]
        first = partial[0].device
        final = torch.empty(3, dtype=torch.float32, device=first)
        gathered = torch.stack([r.to(first, non_blocking=True) for r in partial])
        ops.merge_gradient_stats_chunks(gathered, final)
        return final

    def _tensor_norm_clip(self, fused, generic, scopes, grad_scale):
        """clip_grad_norm_'s coefficient from a tensor-operation norm (no native stats);
        ``scopes`` are those of the generic path's gradients, in order."""
        by_scope: dict = {}
        for w in fused:
            by_scope.setdefault(w.bucket.scope, []).extend(w.grads)
        generic_grads = [g for _, _, gs in generic for g in gs]
        for scope, g in zip(scopes, generic_grads, strict=True):
            by_scope.setdefault(scope, []).append(_local(g))
        for b in self._all_buckets():
            if b.scope.groups:
                by_scope.setdefault(b.scope, [])
        if not by_scope:
            return None
        grads = [g for gs in by_scope.values() for g in gs]
        first = grads[0].device if grads else next(iter(self._all_buckets())).device
        squares = []
        for scope, gs in by_scope.items():
            sq = torch.zeros((), dtype=torch.float32, device=first)
            for g in gs:
                sq = sq + torch.linalg.vector_norm(g, dtype=torch.float32).to(first).square()
            squares.append(globalize_sum(sq, scope))
        total = torch.stack(squares).sum().sqrt()
        if grad_scale is not None:
            total = total / grad_scale.to(first).reshape(())
        return (self.max_grad_norm / (total + 1e-6)).clamp(max=1.0).reshape(1)


def _split_by_dtype(work: _FusedWork) -> list[_FusedWork]:
    """One kernel call takes one gradient dtype: split a bucket's active parameters by
    the dtype of their gradients (normally a single dtype, and no split)."""
    dtypes = set(map(_dtype_of, work.grads))
    if len(dtypes) == 1:
        return [work]
    parts = []
    for dtype in sorted(dtypes, key=str):
        keep = [k for k, g in enumerate(work.grads) if g.dtype == dtype]
        parts.append(
            _FusedWork(
                work.bucket,
                work.group,
                [work.active[k] for k in keep],
                [work.grads[k] for k in keep],
                work.gi,
            )
        )
    return parts


_dtype_of = operator.attrgetter("dtype")


class _PerDevice:
    """Copies of small control tensors on each device that needs them, made once a step."""

    def __init__(self):
        self._cache: dict = {}

    def get(self, t: torch.Tensor | None, device: torch.device):
        if t is None:
            return None
        if t.device == device:
            return t.reshape(-1) if t.dim() != 1 else t
        key = (id(t), device)
        if key not in self._cache:
            self._cache[key] = t.to(device, non_blocking=True).reshape(-1)
        return self._cache[key]


def _row_pieces(numels: list[int]) -> list[tuple[int, int, int]]:
    """Split a bucket's gradients (given by their sizes) into runs of at most MAX_ROWS
    statistics rows: (first tensor, end tensor, rows). A bucket normally is one piece."""
    pieces, lo, rows = [], 0, 0
    for i, numel in enumerate(numels):
        r = ops.stats_rows_for(numel)
        if r > MAX_ROWS:
            raise ValueError(
                f"a gradient of {numel:,} elements needs {r:,} statistics rows; one report "
                f"holds at most {MAX_ROWS:,} rows ({MAX_ROWS * STATS_CHUNK:,} elements)"
            )
        if rows + r > MAX_ROWS:
            pieces.append((lo, i, rows))
            lo, rows = i, 0
        rows += r
    if rows > 0 or not pieces:
        pieces.append((lo, len(numels), rows))
    return [p for p in pieces if p[2] > 0]


def _check_fused_param(p: torch.Tensor, gi: int, j: int) -> None:
    if p.is_complex() or not p.is_floating_point():
        raise ValueError(
            f"fused_step=True supports real floating parameters only; param group {gi} "
            f"parameter {j} is {p.dtype}"
        )
    if p.dtype != torch.float32:
        raise ValueError(
            f"fused_step=True needs float32 (master) parameters; param group {gi} parameter {j} "
            f"is {p.dtype}. Keep FP32 master weights, or use fused_step=False for this group"
        )
    local = _local(p)
    if not local.is_contiguous():
        raise ValueError(
            f"fused_step=True needs contiguous parameters; param group {gi} parameter {j} has "
            f"strides {tuple(local.stride())}"
        )
    check_device(local.device, "ruda_torch.AdamW(fused_step=True)")


def _check_grads(grads, gi: int, fused: bool = True) -> None:
    # The common case in two C-level passes (thousands of parameters per step); the loop
    # below only runs to name the offending gradient.
    if not any(map(_is_sparse, grads)) and (
        not fused or all(map(torch.Tensor.is_contiguous, map(_local, grads)))
    ):
        return
    for j, g in enumerate(grads):
        if g.is_sparse:
            raise RuntimeError(
                f"ruda_torch.AdamW does not support sparse gradients (param group {gi}, "
                f"parameter {j}); use a dense gradient (e.g. nn.Embedding(sparse=False))"
            )
        if fused and not _local(g).is_contiguous():
            raise RuntimeError(
                f"fused_step=True needs contiguous gradients; param group {gi} parameter {j} "
                f"has a gradient with strides {tuple(_local(g).stride())} for shape "
                f"{tuple(g.shape)}"
            )


_is_sparse = operator.attrgetter("is_sparse")


def _fresh_state(p: torch.Tensor, amsgrad: bool) -> dict:
    st = {
        "step": torch.zeros((), dtype=torch.float32, device=_local(p).device),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if amsgrad:
        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def _generic_update(p, grad, st, group, grad_scale, found_inf, clip_coef) -> None:
    """The tensor-operation path: SPEC section 1 with torch ops, no host sync. Bias
    corrections are computed from the device step counter in FP64 and cast once."""
    beta1, beta2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    # DTensor parameters are updated through their local shards, like the fused path.
    p, grad = _local(p), _local(grad)
    st = {k: _local(v) for k, v in st.items()}
    if torch.is_complex(p):
        p, grad = torch.view_as_real(p), torch.view_as_real(grad)
        st = {k: (torch.view_as_real(v) if k != "step" else v) for k, v in st.items()}
    skip = None if found_inf is None else (found_inf.reshape(()) != 0)
    step_t = st["step"]
    if skip is None:
        step_t += 1
    else:
        step_t += (~skip).to(step_t.dtype)
    g = grad.to(p.dtype) if grad.dtype != p.dtype else grad
    factor = None
    if clip_coef is not None:
        factor = clip_coef.reshape(()).to(p.dtype)
    if grad_scale is not None:
        inv = 1.0 / grad_scale.reshape(()).to(p.dtype)
        factor = inv if factor is None else factor * inv
    if factor is not None:
        g = g * factor
    if group["maximize"]:
        g = -g
    t64 = step_t.to(torch.float64)
    bc1 = (1.0 - torch.pow(beta1, t64)).to(p.dtype)
    bc2 = (1.0 - torch.pow(beta2, t64)).to(p.dtype)
    m, v = st["exp_avg"], st["exp_avg_sq"]
    m_new = m * beta1 + g * (1.0 - beta1)
    v_new = v * beta2 + (g * g) * (1.0 - beta2)
    v_used = v_new
    vmax_new = None
    if group["amsgrad"]:
        vmax_new = torch.maximum(st["max_exp_avg_sq"], v_new)
        v_used = vmax_new
    denom = (v_used / bc2).sqrt() + eps
    p_new = p * (1.0 - lr * wd) - (m_new / bc1) * lr / denom
    updates = [(p, p_new), (m, m_new), (v, v_new)]
    if vmax_new is not None:
        updates.append((st["max_exp_avg_sq"], vmax_new))
    for dst, src in updates:
        dst.copy_(src if skip is None else torch.where(skip, dst, src))
