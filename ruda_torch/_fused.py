"""The fused path's flat buckets, and the rules that keep them derived from
``optimizer.state`` and ``param_groups``.

Note [Buckets]
With ``fused_step=True`` the parameters of one param group on one device with one dtype,
one scope (Note [Scopes] in ruda_torch/distributed.py) and one moment precision form a
bucket: flat buffers ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with AMSGrad;
FP64 for FP64 parameters, else FP32, BF16 or 8-bit codes with their scales as the group's
``state_precision`` says, Note [8-bit buckets]), with ``master_weights`` a flat FP32 ``master`` for
FP16/BF16 parameters (int16 remainders for BF16 ones with ``"remainder"``), in which every parameter owns a contiguous
slice (starting on a 64-byte boundary, so the kernels use wide accesses), and a flat FP32
``steps`` buffer with one counter per parameter. ``optimizer.state[p]`` holds views into
these buffers, shaped like ``p`` (with ``p``'s strides when ``p`` is dense but not
contiguous, e.g. transposed or channels_last: slice element k is the parameter's k-th
element in memory, so the kernel walks both front to back, Note [Dense layouts] in
csrc/bindings.cpp), so ``state_dict()`` has exactly torch.optim.AdamW's format (plus
``master_param`` with master weights) while one kernel launch updates the whole bucket.
A parameter that is not dense (a view with gaps, such as ``w[..., 0]``) is stepped
through a contiguous staging copy: copied in before the kernel and back after it. Buffers
are not reallocated in the steady state. DTensor parameters are stepped on their local
shards; their state views are DTensors around local slices.

Note [Master weights]
A 16-bit parameter's master copy is the FP32 value it is rounded from. The kernel takes
the master where the parameter still holds the master rounded to nearest even, and the
parameter's own value where it does not: whatever wrote the parameter since the last
step (a load of model weights, ``p.data.copy_``, an initialization) is honoured at that
element, at the cost of reading the parameter (2 bytes per element) in the same pass.
So a master is never stale, a checkpoint without one (torch's) starts from the
parameter, and one with one (ours) resumes bit for bit.
With ``master_weights="remainder"`` (BF16 parameters) the master is the parameter's bits
and an int16 remainder (Note [Remainder master] in csrc/adamw_math.h), which cannot tell
a written element from a stepped one: the parameter's version counter stands in for the
comparison, per tensor. A parameter whose version moved since the bucket's last step
(``reset_written``) has its remainders zeroed, so the step starts from its value; a write
the counter does not see (``p.data.copy_``) keeps the written value to within half a BF16
unit (the old low half under it).

Note [Flat gradient buckets]
With ``flat_grads=True`` a bucket also owns ``grad_flat``, one gradient buffer in the
parameters' dtype with the state's offsets, and for each parameter a tensor over its
slice (made with ``set_``, so that it is not an autograd view and has a version counter of
its own) that the optimizer makes ``p.grad``; backward accumulates into it in place
(AccumulateGrad adds into an existing gradient when grad mode is off). Three facts are
kept per bucket, and checked by one C loop per step (``_C.flat_check``):
- which gradients are still their views: ``p.grad`` is the view object, and the view is
  still exactly the view of its slice: storage, offset, dtype, sizes and strides (Note
  [Exact views] in csrc/py_records.h: ``p.grad.data = t``, ``t_()``, ``resize_`` are all
  seen, whatever else shares the buffer). Any other gradient (assigned, None, allocated by
  backward after ``model.zero_grad()``, or the view re-pointed or re-shaped in place; a
  view that is no longer exact is made anew) makes the step take the bucket's gradients
  where they are, as without flat_grads, and afterwards copy them into the views and put
  the views back (``adopt_grads``): never a step from a stale buffer;
- which views were written since ``zero_grad()``: ``clean[i]`` is the view's version
  when zero_grad left it unwritten, -1 when it holds a gradient; an unwritten view is a
  parameter without a gradient, not stepped, torch's rule for a None gradient;
- the native handle (``_C.flat_bucket``): the bucket's tensor table, validated once as
  adamw_scaled_ validates it, with the gradient addresses in the buffer. A step checks
  that no parameter's memory moved (``p.data = ...``; a new handle is validated if one
  did) and launches on the table, on CUDA kept in device memory (csrc/bindings.h).
The rest of the step (state, statistics, clipping, the atomic validation) is the same
for both kinds of bucket; only where the gradients are read from differs.
"""

from __future__ import annotations

import math

import torch

from . import _C, ops
from ._common import (
    MASTER_KEY,
    MASTER_KEYS,
    REMAINDER_KEY,
    STATE_KEYS,
    codes4_key,
    codes_key,
    is_dense,
    local,
    own,
    scales4_key,
    scales_key,
)
from ._remainder import master_from_remainder, remainder_of_master
from ._state8bit import coded_format, moment_values, wrap_scales
from ._validate import check_flat_grad_dtype
from .distributed import LOCAL
from .stats_plan import MAX_ROWS, StatsPlan, row_pieces

_ALIGN = 16  # elements: 64-byte aligned slices (FP32; 128 bytes for FP64, 32 for BF16)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def state_dtype_of(param_dtype: torch.dtype, precision: str) -> torch.dtype:
    """The moments' dtype of a bucket (Note [Parameter dtypes], Note [Low-precision
    states] in csrc/adamw_math.h; uint8: Note [8-bit buckets])."""
    if param_dtype == torch.float64:
        return torch.float64
    coded = coded_format(precision)
    if coded is not None:
        return coded.state_dtype
    return torch.bfloat16 if precision == "bf16" else torch.float32


class Bucket:
    """Flat state of one (param group, device); see Note [Buckets]."""

    def __init__(
        self,
        params: list[torch.Tensor],
        amsgrad: bool,
        scope=LOCAL,
        master: str | None = None,
        flat: bool = False,
        precision: str = "fp32",
    ):
        self.params = params
        self.shapes = [p.shape for p in params]
        self.strides = [p.stride() for p in params]
        self.scope = scope  # Note [Scopes] in ruda_torch/distributed.py
        self.distributed = any(hasattr(p, "device_mesh") for p in params)
        self.locals = [local(p) for p in params] if self.distributed else params
        self.device = self.locals[0].device if params else torch.device("cpu")
        self.dtype = self.locals[0].dtype if params else torch.float32
        self.precision = precision  # Note [Low-precision states] in csrc/adamw_math.h
        # Blockwise codes (8-bit or 4-bit moments): the format's object answers what the
        # layout needs (ruda_torch/_state8bit.py, _state4bit.py); None for values.
        self.coded = coded_format(precision) if self.dtype != torch.float64 else None
        self.eight_bit = self.coded is not None  # coded moments (8 or 4 bits)
        coded = self.coded
        align = coded.block if coded else _ALIGN
        # With coded moments, each slot's rows (Note [8-bit row blocks] in csrc/quant8.h):
        # their length where they are not whole blocks (0: the flat tensor's blocks), and
        # its scales (one per block).
        self.rows8 = [coded.ragged_row(t.shape) if coded else 0 for t in self.locals]
        self.blocks = [math.prod(coded.scales_shape(t.shape)) if coded else 0 for t in self.locals]
        offsets, total = [], 0
        for t in self.locals:
            offsets.append(total)
            total += -(-t.numel() // align) * align
        self.offsets = offsets
        self.capacity = total  # state elements of each moment buffer
        # Each moment's run of scales: a flat slot's at its offset / block, then those of
        # the slots whose rows are not whole blocks, one after another.
        self.scale_offsets, run = [], total // align if coded else 0
        for i, off in enumerate(offsets):
            self.scale_offsets.append(run if self.rows8[i] else off // align)
            run += self.blocks[i] if self.rows8[i] else 0
        self.scale_run = run
        state_dtype = state_dtype_of(self.dtype, precision)
        opts = dict(dtype=state_dtype, device=self.device)
        length = total // coded.per_byte if coded else total  # 4 bits: two per byte
        self.exp_avg = torch.zeros(length, **opts)
        self.exp_avg_sq = torch.zeros(length, **opts)
        self.max_exp_avg_sq = torch.zeros(length, **opts) if amsgrad else None
        self.scales = None
        if coded:
            runs = 3 if amsgrad else 2
            self.scales = torch.zeros(runs * self.scale_run, dtype=torch.float32,
                                      device=self.device)  # fmt: skip
        # The masters of 16-bit parameters (master_weights): FP32, or for BF16 parameters
        # the int16 remainders of FP32 ones (Note [Remainder master] in csrc/adamw_math.h),
        # which the kernel tells apart by their dtype.
        self.master_kind = _master_kind(master, self.dtype)
        self.master_key = REMAINDER_KEY if self.master_kind == "remainder" else MASTER_KEY
        self.master = (
            None
            if self.master_kind is None
            else torch.zeros(total, device=self.device,
                             dtype=torch.int16 if self.master_kind == "remainder" else torch.float32)
        )  # fmt: skip
        # The parameters' versions after this bucket last wrote them (remainder masters): a
        # parameter written since restarts its master from its value (Note [Master weights]).
        self.versions: list[tuple[int, int] | None] = [None] * len(params)
        self.steps = torch.zeros(len(params), dtype=torch.float32, device=self.device)
        # What the kernel steps: the local tensors, with a contiguous staging copy in place
        # of each that is not dense (Note [Buckets]); with 8-bit moments, of each that is
        # not contiguous (the blocks are the rows': Note [8-bit row blocks] in
        # csrc/quant8.h).
        self.staged = [
            i
            for i, t in enumerate(self.locals)
            if not (t.is_contiguous() if self.eight_bit else is_dense(t))
        ]
        self.targets = list(self.locals)
        for i in self.staged:
            t = self.locals[i]
            self.targets[i] = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        # (offset, step counter, and with 8-bit moments the row length and first scale) per
        # slot (ops.adamw_scaled_'s slots).
        extra = (
            (lambda i: [self.rows8[i], self.scale_offsets[i]]) if self.eight_bit else (lambda i: [])
        )
        self.slots_all = torch.tensor(
            [[off, i, *extra(i)] for i, off in enumerate(offsets)], dtype=torch.int64
        ).reshape(-1, 4 if self.eight_bit else 2)
        # views[i]: the state values this bucket put into entries[i] (the state entry of
        # params[i]), or None while params[i] has no state.
        self.views: list[dict | None] = [None] * len(params)
        self.facts: list[dict | None] = [None] * len(params)  # of views[i], by key
        self.entries: list = [None] * len(params)
        self.n_with_state = 0
        self.zeroed = [True] * len(params)  # slot i holds zeros (fresh buffers do)
        self.all_slots = list(range(len(params)))
        self._slots_cache: tuple | None = None
        self._pieces_cache: tuple | None = None
        self.n_rows_all = sum(ops.stats_rows_for(t.numel()) for t in self.locals)
        self.rows = None  # statistics buffers, allocated on first use
        self.scratch = None
        # Note [Flat gradient buckets]: the flat gradient buffer, a view of it per parameter
        # (what p.grad is), and for each view the version it had when zero_grad() left it
        # unwritten (-1: it holds a gradient whatever its version).
        self.grad_flat = self.grad_views = self.clean = self._handle = None
        self.replaced_in_a_row = 0  # steps in a row that found views replaced
        if flat:
            self.grad_flat = torch.zeros(total, dtype=self.dtype, device=self.device)
            self.grad_facts = [None] * len(params)  # view_record of each view
            self.grad_views = [self._grad_view(i) for i in range(len(params))]
            self.clean = torch.full((len(params),), -1, dtype=torch.int64)

    @property
    def buffers(self) -> list[torch.Tensor]:
        bufs = [self.exp_avg, self.exp_avg_sq, self.steps]
        extra = (self.max_exp_avg_sq, self.master, self.scales)
        return bufs + [b for b in extra if b is not None]

    @property
    def moments(self) -> tuple[str, ...]:
        """The moments whose values live in this bucket."""
        return STATE_KEYS if self.max_exp_avg_sq is not None else STATE_KEYS[:2]

    @property
    def managed_keys(self) -> tuple[str, ...]:
        """The state keys whose values live in this bucket: each moment under its own
        name, or as its coded pair (Note [8-bit state entries] in ruda_torch/_state8bit.py,
        Note [4-bit state entries] in ruda_torch/_state4bit.py)."""
        if self.coded:
            keys = [k for key in self.moments
                    for k in (self.coded.codes_key(key), self.coded.scales_key(key))]  # fmt: skip
        else:
            keys = list(self.moments)
        return ("step", *keys) if self.master is None else ("step", *keys, self.master_key)

    @property
    def foreign_keys(self) -> tuple[str, ...]:
        """The other form of this bucket's moments (and of its master): never in an entry
        it owns. Without a master, a remainder goes too: kept, it would no longer match the
        parameter it was split from when a later group with master_weights="remainder" took
        it up again (an FP32 master is kept, as before: True checks it element by element)."""
        if self.master is None:
            other = (REMAINDER_KEY,)
        else:
            other = tuple(k for k in MASTER_KEYS if k != self.master_key)
        forms = (
            *self.moments,
            *(k for key in self.moments for k in (codes_key(key), scales_key(key))),
            *(k for key in self.moments for k in (codes4_key(key), scales4_key(key))),
        )
        mine = set(self.managed_keys)
        return (*(k for k in forms if k not in mine), *other)

    def can_serve(
        self, params: list, scope, amsgrad: bool, master, flat: bool, precision: str
    ) -> bool:
        """Whether this bucket can stay the bucket of ``params`` (Note [Fused state
        coherence], step 1)."""
        return (
            len(params) == len(self.params)
            and all(map(_same, params, self.params))
            and all(p.shape == s for p, s in zip(params, self.shapes, strict=True))
            and all(p.stride() == s for p, s in zip(params, self.strides, strict=True))
            and all(p.dtype == self.dtype for p in params)
            and scope == self.scope
            and all(local(p).device == self.device for p in params)
            and (self.max_exp_avg_sq is not None or not amsgrad)
            and self.master_kind == _master_kind(master, self.dtype)
            and self.flat == flat
            and self.precision == precision
        )

    def _slice(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Slot i of a flat buffer, shaped (and for a dense parameter strided) like it."""
        return self._laid_out(buf[self.offsets[i] : self.offsets[i] + self.locals[i].numel()], i)

    def _laid_out(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """A 1-D tensor of params[i]'s local numel as the slot lays it out: shaped like the
        parameter, with its strides when it is dense (its element k is slot element k)."""
        t = self.locals[i]
        if t.is_contiguous() or i in self.staged:
            return flat.view(t.shape)
        return flat.as_strided(t.shape, t.stride())

    def _pair(self, key: str, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot i of coded moment ``key`` as tensors of their own: its uint8 codes (shaped
        like the (local) parameter for 8 bits, two per byte for 4: the format's
        codes_shape), contiguous, and its scales, of the format's scales_shape (Note [8-bit
        row blocks] in csrc/quant8.h)."""
        t, coded = self.locals[i], self.coded
        codes = own(getattr(self, key).view(torch.uint8), self.offsets[i] // coded.per_byte,
                    coded.codes_shape(t.shape))  # fmt: skip
        run = STATE_KEYS.index(key) * self.scale_run
        scales = own(self.scales, run + self.scale_offsets[i], coded.scales_shape(t.shape))
        return codes, scales

    def scales_for(self, amsgrad: bool) -> torch.Tensor | None:
        """The scales a step takes: every moment's run, or without AMSGrad the first two
        (a bucket that has the maximum's runs, stepped without it)."""
        if self.scales is None or amsgrad or self.max_exp_avg_sq is None:
            return self.scales
        return self.scales[: 2 * self.scale_run]

    def _own_slice(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Slot i of a flat buffer as a tensor of its own (not a view in autograd's sense),
        laid out like the kernel steps the parameter: its strides when dense, contiguous
        when staged. What the state and the flat gradients hold (Note [Tensors of their
        own] in csrc/py_records.h)."""
        t = self.locals[i]
        stride = None if i in self.staged else t.stride()
        return own(buf, self.offsets[i], t.shape, stride)

    def _grad_view(self, i: int) -> torch.Tensor:
        """Slot i of the flat gradient buffer (_own_slice: its own version counter too)."""
        view = self._own_slice(self.grad_flat, i)
        self.grad_facts[i] = _C.view_record([view])
        return view

    def _exact_view(self, i: int) -> torch.Tensor:
        """grad_views[i], made again (and the handle with it) when it is no longer exactly
        the view of slot i (Note [Exact views] in csrc/py_records.h): ``p.grad.data = t``,
        ``set_``, ``t_()``, ``resize_``, a new dtype all change the view object itself."""
        view = self.grad_views[i]
        if _C.view_record([view]) != self.grad_facts[i]:
            view = self.grad_views[i] = self._grad_view(i)
            self._handle = None
        return view

    @property
    def flat(self) -> bool:
        return self.grad_flat is not None

    def handle(self):
        """The native handle of the flat bucket (Note [Flat gradient buckets] in
        csrc/bindings.h), made again when a parameter's memory moved."""
        if self._handle is None:
            self._handle = _C.flat_bucket(
                list(self.locals), list(self.targets), self.grad_views, self.grad_flat,
                self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq, self.steps,
                self.slots_all, self.master, self.scales,
            )  # fmt: skip
        return self._handle

    def check_grads(self) -> tuple[list[int], list[int]]:
        """(replaced, unwritten): the parameters whose ``grad`` is not their view any more,
        and those whose view was not written since zero_grad(). Reads only."""
        current, replaced, unwritten = _C.flat_check(self.handle(), self.clean)
        if not current:  # `p.data = ...` moved a parameter: validate a new handle
            self._handle = None
            current, replaced, unwritten = _C.flat_check(self.handle(), self.clean)
        return replaced, unwritten

    def check_replaced(self, indices: list[int], gi=None) -> None:
        """The parameters whose views would be put back can take them (reads only)."""
        group = "" if gi is None else f"param group {gi}: "
        for i in indices:
            p = self.params[i]
            check_flat_grad_dtype(p, f"{group}the parameter of shape {tuple(p.shape)}")

    def adopt_grads(self, indices: list[int]) -> None:
        """Make ``p.grad`` the view again for each listed parameter, keeping its value: a
        replaced gradient is copied into the view, a missing one leaves the view zero and
        unwritten (the parameter still has no gradient for the step)."""
        for i in indices:
            p = self.params[i]
            g = p.grad
            view = self._exact_view(i)
            if g is None:
                view.zero_()
                self.clean[i] = view._version
            else:
                if g is not view:
                    g = local(g)
                    if (
                        g.untyped_storage().data_ptr()
                        == self.grad_flat.untyped_storage().data_ptr()
                    ):
                        g = g.clone()  # the old view itself, re-strided (``t_()``): overlaps
                    view.copy_(g)
                self.clean[i] = -1
            p.grad = view

    def zero_grads(self, set_to_none: bool, replaced: list[int]) -> None:
        """optimizer.zero_grad() for this bucket: one fill of the flat buffer, the views
        kept (reinstalled where something replaced them: ``replaced``, from check_grads()
        and check_replaced() of every bucket before any is written)."""
        had_none = [i for i in replaced if self.params[i].grad is None]
        self.grad_flat.zero_()
        for i in replaced:
            self.params[i].grad = self._exact_view(i)
        _C.flat_mark(self.handle(), self.clean, set_to_none)
        for i in had_none:  # as torch: a missing gradient stays missing without set_to_none
            self.clean[i] = self.grad_views[i]._version

    def _staged_active(self, active: list[int]) -> list[int]:
        if len(active) == len(self.params):
            return self.staged
        chosen = set(active)
        return [i for i in self.staged if i in chosen]

    def stage_in(self, active: list[int]) -> None:
        """Copy the active non-dense parameters into their staging tensors."""
        for i in self._staged_active(active):
            self.targets[i].copy_(local(self.params[i]))

    def stage_out(self, active: list[int]) -> None:
        for i in self._staged_active(active):
            local(self.params[i]).copy_(self.targets[i])

    def holds_state(self, state) -> bool:
        """Whether some parameter's state entry in ``state`` is still this bucket's."""
        return any(
            self.entries[i] is not None and state.get(p) is self.entries[i]
            for i, p in enumerate(self.params)
        )

    def owns(self, i: int, entry) -> bool:
        """``entry`` holds exactly the views of slot i for every key this bucket manages,
        and they still show the slot's memory (``view.data = ...`` moves it)."""
        views = self.views[i]
        if views is None or entry is not self.entries[i]:
            return False
        for key in self.managed_keys:
            mine = views.get(key)
            if (entry.get(key) is not mine) if mine is not None else (key in entry):
                return False
            if type(mine) is torch.Tensor and _C.view_record([mine]) != self.facts[i][key]:
                return False  # no longer exactly the view install() made
        return not any(key in entry for key in self.foreign_keys)

    def write_slot(self, i: int, step: float, values: dict) -> None:
        """Slot i := ``step`` and the moments in ``values`` (zeros for a missing one); the
        master := ``values``' one, or the parameter's value (Note [Master weights])."""
        self.steps[i].fill_(step)
        for key in STATE_KEYS:
            buf = getattr(self, key)
            if buf is None:
                continue
            if self.coded:
                self._write_coded(i, key, values)
                continue
            src = moment_values(values, key)
            if src is None:
                self._slice(buf, i).zero_()
            else:
                self._slice(buf, i).copy_(local(src))
        if self.master_kind == "fp32":
            src = values.get(MASTER_KEY)
            if src is None and values.get(REMAINDER_KEY) is not None:
                src = master_from_remainder(local(self.params[i]), local(values[REMAINDER_KEY]))
            self._slice(self.master, i).copy_(local(self.params[i]) if src is None else local(src))
        elif self.master_kind == "remainder":
            src = values.get(REMAINDER_KEY)
            if src is None and values.get(MASTER_KEY) is not None:
                src = remainder_of_master(local(self.params[i]), local(values[MASTER_KEY]))
            dst = self._slice(self.master, i)
            if src is None:
                dst.zero_()  # the master is the parameter (torch's checkpoint, a fresh slot)
            else:
                dst.copy_(local(src))
            self.versions[i] = None
        self.zeroed[i] = False

    def _write_coded(self, i: int, key: str, values: dict) -> None:
        """Slot i of coded moment ``key`` := ``values``' one: codes and scales copied when
        they are this format's pair with the slot's blocks (Note [8-bit state entries]
        and Note [4-bit state entries]; whatever the codes' strides), else the moment's
        values quantized (an FP32 moment, the other format's pair or the earlier 8-bit
        format's codes decoded first: Note [8-bit blocks on every mesh]); zeros when there
        is none."""
        coded = self.coded
        codes, scales = self._pair(key, i)
        src_codes = values.get(coded.codes_key(key))
        if src_codes is not None:
            src_scales = values[coded.scales_key(key)]
            if coded.same_blocks(src_codes, src_scales):
                codes.copy_(src_codes)
                scales.view(-1).copy_(src_scales.reshape(-1)[: self.blocks[i]])
                return
        src = moment_values(values, key)
        if src is None:
            codes.zero_()
            scales.zero_()
            return
        new_codes, new_scales = coded.quantize(local(src).to(torch.float32), key)
        codes.copy_(new_codes)
        scales.copy_(new_scales)

    def _versions_of(self, i: int) -> tuple[int, int]:
        """The version counters of params[i] and of its remainders' state view."""
        return self.locals[i]._version, local(self.views[i][REMAINDER_KEY])._version

    def reset_written(self, active: list[int]) -> None:
        """Remainder masters (Note [Master weights]): a parameter that something wrote in
        place since this bucket's last step (its version counter moved: a model load,
        ``copy_`` or an initialization under no_grad) restarts its master from its value,
        remainders 0, unless its remainders were written too (a checkpoint loaded in
        place, as DCP loads: the pair is restored). Not while a CUDA graph is captured: a
        captured reset would run at every replay."""
        if self.master_kind != "remainder":
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        for i in active:
            seen = self.versions[i]
            if seen is None or self.views[i] is None:
                continue
            param, remainder = self._versions_of(i)
            if param != seen[0] and remainder == seen[1]:
                self._slice(self.master, i).zero_()

    def note_versions(self, active: list[int]) -> None:
        """The versions the step left the parameters and remainders at (reset_written
        compares)."""
        if self.master_kind == "remainder":
            for i in active:
                self.versions[i] = None if self.views[i] is None else self._versions_of(i)

    def own_views(self, i: int, with_max: bool) -> dict:
        """The state values of slot i, as install() puts them into an entry: tensors of
        their own over the slot (Note [Tensors of their own] in csrc/py_records.h)."""
        p = self.params[i]
        views = {"step": own(self.steps, i, ())}
        for key in self.moments:
            if key == "max_exp_avg_sq" and not with_max:
                continue
            buf = getattr(self, key)
            if self.coded:
                codes, scales = self._pair(key, i)
                views[self.coded.codes_key(key)] = _wrap_like(codes, p, self.coded)
                views[self.coded.scales_key(key)] = wrap_scales(scales, p, self.coded)
            else:
                views[key] = _wrap_like(self._own_slice(buf, i), p)
        if self.master is not None:
            views[self.master_key] = _wrap_like(self._own_slice(self.master, i), p)
        return views

    def install(self, i: int, entry, views: dict) -> None:
        """Put own_views(i) into ``entry`` (a state dict entry, mutated in place), without
        the other form of its moments (Note [8-bit state entries] in ruda_torch/_state8bit.py)."""
        entry.update(views)
        for key in self.foreign_keys:
            entry.pop(key, None)
        if self.views[i] is None:
            self.n_with_state += 1
        self.views[i], self.entries[i] = views, entry
        # Note [Exact views] in csrc/py_records.h: what owns() compares.
        self.facts[i] = {
            k: _C.view_record([v]) for k, v in views.items() if type(v) is torch.Tensor
        }

    def forget(self, i: int) -> None:
        """params[i] has no state any more (its entry was removed or emptied)."""
        if self.views[i] is not None:
            self.n_with_state -= 1
        self.views[i] = self.entries[i] = self.facts[i] = None

    def clear_fresh(self, i: int) -> None:
        """Slot i := fresh zero state (a removed entry's values or a master may be there),
        for params[i]'s first step with a gradient; install() follows."""
        if not self.zeroed[i] or self.master is not None:
            self.write_slot(i, 0.0, {})
        self.zeroed[i] = False

    def slots(self, active: list[int]) -> torch.Tensor:
        if len(active) == len(self.params):
            return self.slots_all
        key = tuple(active)
        if self._slots_cache is None or self._slots_cache[0] != key:
            self._slots_cache = (key, self.slots_all[list(active)].contiguous())
        return self._slots_cache[1]

    def row_pieces(self, active: list[int]) -> list[tuple[int, int, int]]:
        """stats_plan.row_pieces() of the active parameters, cached like slots()."""
        key = None if len(active) == len(self.params) else tuple(active)
        if self._pieces_cache is None or self._pieces_cache[0] != key:
            numels = [self.locals[i].numel() for i in active]
            self._pieces_cache = (key, row_pieces(numels))
        return self._pieces_cache[1]

    def stats_buffers(self):
        if self.rows is None:
            self.rows = torch.empty((self.n_rows_all, 3), dtype=torch.float32, device=self.device)
            plan = StatsPlan(max(1, min(self.n_rows_all, MAX_ROWS)))
            self.scratch = torch.empty(
                max(plan.scratch_elements, 1), dtype=torch.float32, device=self.device
            )
        return self.rows, self.scratch


def _master_kind(master, dtype: torch.dtype):
    """The master a bucket of ``dtype`` parameters keeps for a group's master kind
    (_common.master_kind): none for FP32/FP64 parameters, which are their own masters."""
    if master is None or master is False or dtype not in _HALF_DTYPES:
        return None
    return "remainder" if isinstance(master, str) and master == "remainder" else "fp32"


def _same(a, b) -> bool:
    return a is b


def _wrap_like(local_view: torch.Tensor, p: torch.Tensor, coded=None) -> torch.Tensor:
    """State for a DTensor parameter is a DTensor with the parameter's mesh and
    placements around the local slice (of the codes' global shape for coded moments:
    the format's codes_shape); for a plain tensor it is the slice itself."""
    if not hasattr(p, "device_mesh"):
        return local_view
    from torch.distributed.tensor import DTensor

    if coded is not None and coded.per_byte != 1:
        shape = coded.codes_shape(p.shape)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local_view, p.device_mesh, p.placements, run_check=False,
                                  shape=shape, stride=stride)  # fmt: skip
    return DTensor.from_local(
        local_view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
