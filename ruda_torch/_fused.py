"""The fused path's flat buckets, and the rules that keep them derived from
``optimizer.state`` and ``param_groups``.

Note [Buckets]
With ``fused_step=True`` the parameters of one param group on one device with one dtype
and one scope (Note [Scopes] in ruda_torch/distributed.py) form a bucket: flat buffers
``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with AMSGrad; FP64 for FP64
parameters, FP32 for all others), with ``master_weights`` a flat FP32 ``master`` for
FP16/BF16 parameters, in which every parameter owns a contiguous
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

Note [Flat gradient buckets]
With ``flat_grads=True`` a bucket also owns ``grad_flat``, one gradient buffer in the
parameters' dtype with the state's offsets, and for each parameter a tensor over its
slice (made with ``set_``, so that it is not an autograd view and has a version counter of
its own) that the optimizer makes ``p.grad``; backward accumulates into it in place
(AccumulateGrad adds into an existing gradient when grad mode is off). Three facts are
kept per bucket, and checked by one C loop per step (``_C.flat_check``):
- which gradients are still their views: ``p.grad`` is the view object, and the view is
  still exactly the view of its slice: storage, offset, dtype, sizes and strides (Note
  [Exact views] in csrc/module.cpp: ``p.grad.data = t``, ``t_()``, ``resize_`` are all
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

Note [Fused state coherence]
``optimizer.state`` and ``param_groups`` are the truth, as in every torch optimizer; the
buckets are a cache derived from them (a ``FusedPlan``). The plan records what it was
derived from: the identities of the param_groups list, of each group dict and of each
fused group's parameter list and parameters, the ``fused_step``/``amsgrad``/
``master_weights`` flags, the identity of the state mapping and of every (key, value) in
it, of every item of the state entry of a fused parameter, the dtype, device, shape and
strides of every fused parameter, and what every state view in the entries is (its
storage, offset, dtype, sizes and strides, Note [Exact views] in csrc/module.cpp:
``view.data = t`` or ``view.t_()`` keeps the view object but changes what it shows).
Before every step,
``FusedPlan.is_current`` compares all of it: a few Python checks per param group and
loops over pointers in C on all of torch's threads (``_C.unchanged``, Note [Checks on all
threads] in csrc/module.cpp), a few milliseconds for 20,000 parameters and their 60,000
state views, bound by the memory latency of reading each object once. Any difference, whatever made it (``load_state_dict`` of ours, torch's or
ZeroRedundancyOptimizer's, ``state.clear()``, ``opt.state = defaultdict(dict)``,
``opt.state[p] = {...}``, ``del opt.state[p]``, a replaced state tensor, a parameter
replaced, added or removed in a group, ``p.data = ...`` with another shape, a toggled
``amsgrad`` or ``fused_step``), makes the step derive the plan again (``derive``):

1. Decide and validate everything, writing nothing: which buckets are kept (the same
   parameters in the same order with the same shapes, devices and scopes, and an AMSGrad
   buffer where the group needs one) and which are built anew, and for each fused
   parameter what its state entry is:
   - absent or empty: no state; the parameter gets fresh zero state at its next step
     with a gradient, as in torch (its slot is zeroed then);
   - exactly the views of its own slot: nothing to do;
   - anything else (loaded tensors, a user's, views of another slot or of an old
     bucket): checked to be torch.optim.AdamW's state for this parameter (keys, shapes,
     floating dtypes, a valid step counter), to be copied into the slot.
   A parameter with state whose shape changed is an error, as in torch; so are a state
   entry that is not AdamW's, a duplicate parameter and a parameter the kernel cannot take.
2. Commit: copy the adopted values into their slots (sources that share memory with a
   kept bucket are cloned first, so that swapping two entries works), put the slot's
   views into each adopted entry (in place: the entry dict stays the user's object), and
   record the new plan.
A rejected derivation writes nothing and raises, and so does the step that asked for it.
Only identities are compared, never values: an in-place write into a state view
(``state[p]["exp_avg"].zero_()``, ``state[p]["step"].fill_(0)``) is a write into the
bucket itself and needs nothing. The views are checked as facts (Note [Exact views]), not
through a proxy such as the buffer's sharing count, which another tensor kept on the
buffer defeats; the cost is one TensorImpl read per view, in the same prefetched C loop.
DTensor state views (FSDP2) are checked by identity. A tensor taken out of ``optimizer.state`` may still
share memory with the slot it came from (adoption copies in place rather than doubling
the memory of the bucket).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, MutableMapping

import torch

from . import _C, ops
from ._build import check_device
from ._generic import local
from ._validate import (
    BLOCK_8BIT,
    EIGHT_BIT_KEYS,
    MASTER_KEY,
    STATE_KEYS,
    blocks_8bit,
    check_8bit,
    check_state_entry,
    codes_key,
    is_dense,
    moment_format,
    pair_keys,
    scales_key,
)
from .distributed import LOCAL, scope_of
from .stats_plan import MAX_ROWS, StatsPlan, row_pieces

_ALIGN = 16  # elements: 64-byte aligned slices (FP32; 128 bytes for FP64, 32 for BF16)
_HALF_DTYPES = (torch.float16, torch.bfloat16)
STATE_PRECISIONS = ("fp32", "bf16", "8bit")
# Note [8-bit buckets]
# With state_precision="8bit" a parameter of at least ``min_8bit_size`` elements (a group
# option, 4,096 by default; the whole parameter's count, so that every rank of a sharded
# one decides alike) keeps its moments as
# blockwise 8-bit codes (Note [8-bit moments] in csrc/quant8.h): its bucket's moment
# buffers are uint8 codes, every slot starting a block, and one FP32 buffer ``scales``
# holds each moment's scales in turn, one per block (a storage apart from the codes:
# torch.save refuses two dtypes over one storage). Smaller parameters (biases, norms: a sliver of the memory,
# and the ones whose few blocks quantize worst) keep FP32 moments in a bucket of their
# own, as bitsandbytes' (its ``min_8bit_size``) and torchao's 8-bit optimizers do below
# 4,096 elements. The state entries hold each moment as a codes/scales pair (Note [8-bit
# state entries] in ruda_torch/_validate.py).
MIN_8BIT_SIZE = 4096


def bucket_precision(p: torch.Tensor, group: dict) -> str:
    """The moment storage of ``p``'s bucket in ``group`` (Note [8-bit buckets])."""
    precision = group.get("state_precision", "fp32")
    if precision == "8bit" and p.numel() < group.get("min_8bit_size", MIN_8BIT_SIZE):
        return "fp32"
    return precision


def state_dtype_of(param_dtype: torch.dtype, precision: str) -> torch.dtype:
    """The moments' dtype of a bucket (Note [Parameter dtypes], Note [Low-precision
    states] in csrc/adamw_math.h; uint8: Note [8-bit buckets])."""
    if param_dtype == torch.float64:
        return torch.float64
    return {"bf16": torch.bfloat16, "8bit": torch.uint8}.get(precision, torch.float32)


def _moment_code(key: str) -> str:
    """The 8-bit code of a moment (ops.CODES_8BIT): signed for the first, unsigned for the
    squares."""
    return "signed" if key == "exp_avg" else "unsigned"


FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class Bucket:
    """Flat state of one (param group, device); see Note [Buckets]."""

    def __init__(
        self,
        params: list[torch.Tensor],
        amsgrad: bool,
        scope=LOCAL,
        master: bool = False,
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
        self.eight_bit = precision == "8bit" and self.dtype != torch.float64
        align = BLOCK_8BIT if self.eight_bit else _ALIGN
        # Scales per slot with 8-bit moments: the blocks of the local slice, or of the
        # largest shard of a DTensor (Note [8-bit DTensor state]).
        self.blocks = [
            blocks_8bit(_slot_numel(p, t)) if self.eight_bit else 0
            for p, t in zip(params, self.locals, strict=True)
        ]
        offsets, total = [], 0
        for t, blocks in zip(self.locals, self.blocks, strict=True):
            offsets.append(total)
            span = blocks * BLOCK_8BIT if self.eight_bit else t.numel()
            total += -(-span // align) * align
        self.offsets = offsets
        self.capacity = total  # state elements of each moment buffer
        state_dtype = state_dtype_of(self.dtype, precision)
        opts = dict(dtype=state_dtype, device=self.device)
        self.exp_avg = torch.zeros(total, **opts)
        self.exp_avg_sq = torch.zeros(total, **opts)
        self.max_exp_avg_sq = torch.zeros(total, **opts) if amsgrad else None
        self.scales = None
        if self.eight_bit:
            runs = 3 if amsgrad else 2
            self.scales = torch.zeros(runs * total // BLOCK_8BIT, dtype=torch.float32,
                                      device=self.device)  # fmt: skip
        self.master = (
            torch.zeros(total, dtype=torch.float32, device=self.device)
            if master and self.dtype in _HALF_DTYPES
            else None
        )
        self.steps = torch.zeros(len(params), dtype=torch.float32, device=self.device)
        # What the kernel steps: the local tensors, with a contiguous staging copy in place
        # of each that is not dense (Note [Buckets]).
        self.staged = [i for i, t in enumerate(self.locals) if not is_dense(t)]
        self.targets = list(self.locals)
        for i in self.staged:
            t = self.locals[i]
            self.targets[i] = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        self.slots_all = torch.tensor(
            [[off, i] for i, off in enumerate(offsets)], dtype=torch.int64
        ).reshape(-1, 2)
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
        name, or as its 8-bit pair (Note [8-bit state entries] in _validate.py)."""
        if self.eight_bit:
            keys = list(pair_keys(self.moments))
        else:
            keys = list(self.moments)
        return ("step", *keys) if self.master is None else ("step", *keys, MASTER_KEY)

    @property
    def foreign_keys(self) -> tuple[str, ...]:
        """The other form of this bucket's moments: never in an entry it owns."""
        if self.eight_bit:
            return self.moments
        return pair_keys(self.moments)

    def can_serve(
        self, params: list, scope, amsgrad: bool, master: bool, flat: bool, precision: str
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
            and (self.master is not None) == (master and self.dtype in _HALF_DTYPES)
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
        """Slot i of 8-bit moment ``key`` as 1-D tensors of their own: its codes in slot
        order and its scales (Note [8-bit buckets])."""
        codes = _own(getattr(self, key), self.offsets[i], (self.locals[i].numel(),))
        return codes, self._scales(key, i)

    def _scales(self, key: str, i: int) -> torch.Tensor:
        run = STATE_KEYS.index(key) * (self.capacity // BLOCK_8BIT)
        return _own(self.scales, run + self.offsets[i] // BLOCK_8BIT, (self.blocks[i],))

    def _own_slice(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Slot i of a flat buffer as a tensor of its own (not a view in autograd's sense),
        laid out like the kernel steps the parameter: its strides when dense, contiguous
        when staged. What the state and the flat gradients hold (Note [Tensors of their
        own] in csrc/module.cpp)."""
        t = self.locals[i]
        stride = None if i in self.staged else t.stride()
        return _own(buf, self.offsets[i], t.shape, stride)

    def _grad_view(self, i: int) -> torch.Tensor:
        """Slot i of the flat gradient buffer (_own_slice: its own version counter too)."""
        view = self._own_slice(self.grad_flat, i)
        self.grad_facts[i] = _C.view_record([view])
        return view

    def _exact_view(self, i: int) -> torch.Tensor:
        """grad_views[i], made again (and the handle with it) when it is no longer exactly
        the view of slot i (Note [Exact views] in csrc/module.cpp): ``p.grad.data = t``,
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
            if self.eight_bit:
                self._write_8bit(i, key, values)
                continue
            src = _moment_values(values, key)
            if src is None:
                self._slice(buf, i).zero_()
            else:
                self._slice(buf, i).copy_(local(src))
        if self.master is not None:
            src = values.get(MASTER_KEY)
            self._slice(self.master, i).copy_(local(self.params[i]) if src is None else local(src))
        self.zeroed[i] = False

    def _write_8bit(self, i: int, key: str, values: dict) -> None:
        """Slot i of 8-bit moment ``key`` := ``values``' one: codes and scales copied when
        they are laid out as the slot is, else its values quantized (an FP32 moment, or
        codes of another layout decoded first); zeros when there is none."""
        codes, scales = self._pair(key, i)
        src_codes = values.get(codes_key(key))
        if src_codes is not None and _same_layout(src_codes, self._laid_out(codes, i)):
            src_scales = values[scales_key(key)].reshape(-1)[: self.blocks[i]]
            codes.copy_(_own(src_codes, 0, (src_codes.numel(),)))
            scales.zero_()[: src_scales.numel()].copy_(src_scales)
            return
        src = _moment_values(values, key)
        if src is None:
            codes.zero_()
            scales.zero_()
            return
        staging = torch.empty(codes.numel(), dtype=torch.float32, device=self.device)
        self._laid_out(staging, i).copy_(local(src))
        scales.zero_()
        used = scales[: blocks_8bit(codes.numel())]
        code = ops.CODES_8BIT.index(_moment_code(key))
        torch.ops.ruda_torch.quantize_8bit(staging, codes, used, code)

    def own_views(self, i: int, with_max: bool) -> dict:
        """The state values of slot i, as install() puts them into an entry: tensors of
        their own over the slot (Note [Tensors of their own] in csrc/module.cpp)."""
        p = self.params[i]
        views = {"step": _own(self.steps, i, ())}
        for key in self.moments:
            if key == "max_exp_avg_sq" and not with_max:
                continue
            buf = getattr(self, key)
            if self.eight_bit:
                views[codes_key(key)] = _wrap_like(self._own_slice(buf, i), p)
                views[scales_key(key)] = _wrap_scales(self._scales(key, i), p)
            else:
                views[key] = _wrap_like(self._own_slice(buf, i), p)
        if self.master is not None:
            views[MASTER_KEY] = _wrap_like(self._own_slice(self.master, i), p)
        return views

    def install(self, i: int, entry, views: dict) -> None:
        """Put own_views(i) into ``entry`` (a state dict entry, mutated in place), without
        the other form of its moments (Note [8-bit state entries] in _validate.py)."""
        entry.update(views)
        for key in self.foreign_keys:
            entry.pop(key, None)
        if self.views[i] is None:
            self.n_with_state += 1
        self.views[i], self.entries[i] = views, entry
        # Note [Exact views] in csrc/module.cpp: what owns() compares.
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


def _same(a, b) -> bool:
    return a is b


def _own(
    buf: torch.Tensor, offset: int, shape: torch.Size | tuple, stride: tuple | None = None
) -> torch.Tensor:
    """A tensor of its own over ``buf``'s memory from element ``offset`` (Note [Tensors of
    their own] in csrc/module.cpp): contiguous when ``stride`` is None."""
    t = torch.empty(0, dtype=buf.dtype, device=buf.device)
    if stride is None:
        return t.set_(buf.untyped_storage(), buf.storage_offset() + offset, shape)
    return t.set_(buf.untyped_storage(), buf.storage_offset() + offset, shape, stride)


def _moment_values(values: dict, key: str) -> torch.Tensor | None:
    """Moment ``key`` of an adopted entry's (local) values as a tensor of values shaped
    like the parameter: the tensor itself, or its 8-bit pair decoded (FP32), or None."""
    if key in values:
        return values[key]
    codes = values.get(codes_key(key))
    if codes is None:
        return None
    n = codes.numel()
    decoded = torch.empty(n, dtype=torch.float32, device=codes.device)
    scales = values[scales_key(key)].reshape(-1)[: blocks_8bit(n)]
    ops.dequantize_8bit(_own(codes, 0, (n,)), scales, _moment_code(key), out=decoded)
    return decoded.as_strided(codes.shape, codes.stride())  # the codes' memory order


def dequantize_state_dict(state_dict: dict) -> dict:
    """An optimizer state dict with every 8-bit moment (``state_precision="8bit"``, Note
    [8-bit state entries] in ruda_torch/_validate.py) replaced by its FP32 values under
    torch's name, shaped and laid out like its codes: torch.optim.AdamW's format, which
    torch's AdamW (and ours with any ``state_precision``) loads. Everything else is shared
    with the input, which is not modified. DTensor entries (an FSDP2 sharded state dict)
    are converted shard by shard, into DTensors with the codes' placements."""
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping):
        raise ValueError(
            "dequantize_state_dict takes an optimizer state dict (a dict with 'state' and "
            f"'param_groups', as optimizer.state_dict() returns), got {type(state_dict).__name__}"
        )
    return dequantize_entries(state_dict)


def dequantize_entries(state_dict: dict, only: set | None = None) -> dict:
    """dequantize_state_dict for the entries of the parameter indices in ``only`` (all by
    default)."""
    state = {}
    for index, entry in state_dict["state"].items():
        if (
            (only is not None and index not in only)
            or not isinstance(entry, Mapping)
            or not any(k in entry for k in EIGHT_BIT_KEYS)
        ):
            state[index] = entry
            continue
        where = f"state_dict['state'][{index!r}]"
        new = {k: v for k, v in entry.items() if k == "step"}
        for key in STATE_KEYS:
            if moment_format(entry, key, where) == "8bit":
                codes = entry[codes_key(key)]
                check_8bit(entry, codes, key, where)  # against the codes' own shape
                new[key] = _decoded(codes, entry[scales_key(key)], key)
        new.update((k, v) for k, v in entry.items() if k not in new and k not in EIGHT_BIT_KEYS)
        state[index] = new
    return {**state_dict, "state": state}


def _decoded(codes: torch.Tensor, scales: torch.Tensor, key: str) -> torch.Tensor:
    values = _moment_values({codes_key(key): local(codes), scales_key(key): local(scales)}, key)
    if not hasattr(codes, "device_mesh"):
        return values
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(values, codes.device_mesh, codes.placements, run_check=False,
                              shape=codes.shape, stride=codes.stride())  # fmt: skip


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and equal strides on every dimension of size > 1 (Note [Dense
    layouts] in csrc/bindings.cpp): the same element at each memory position."""
    return a.shape == b.shape and all(
        n <= 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride(), strict=True)
    )


# Note [8-bit DTensor state]
# An 8-bit moment of a DTensor parameter (FSDP2, HSDP, tensor parallel) is a codes DTensor
# with the parameter's mesh and placements around the local codes, and a scales DTensor
# of shape (m_1, ..., m_k, B): one row of B scales per shard, m_j the mesh size along
# dimension j where the parameter is sharded (Shard(j) there) and 1 where it is
# replicated (Replicate there). B is the block count of the largest shard (ceil-divided
# sizes, torch.chunk's), so that every rank's local scales have one shape; a smaller
# shard's row ends in zeros. The blocks follow each rank's local memory order, which only
# the same sharding reproduces: distributed checkpoints (DCP) of this state load exactly
# on the same mesh, and a different number of ranks changes (m_1, ..., m_k), which DCP
# refuses as a size mismatch instead of loading scales of other blocks.
def _slot_numel(p: torch.Tensor, t: torch.Tensor) -> int:
    """The elements a slot reserves for ``p`` (local ``t``): the largest shard's for a
    DTensor (Note [8-bit DTensor state])."""
    if not hasattr(p, "device_mesh"):
        return t.numel()
    shape = list(p.shape)
    for j, placement in enumerate(p.placements):
        if placement.is_shard():
            d = placement.dim
            shape[d] = -(-shape[d] // p.device_mesh.size(j))
    largest = 1
    for n in shape:
        largest *= n
    if t.numel() > largest:
        raise ValueError(
            f"a DTensor parameter of shape {tuple(p.shape)} with placements {p.placements} has "
            f"a local shard of {t.numel()} elements, more than the {largest} of ceil-divided "
            "shards that 8-bit moments reserve: use state_precision='bf16' or 'fp32' for it"
        )
    return largest


def _wrap_scales(scales: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The scales of an 8-bit moment as the entry holds them: the 1-D tensor itself, or
    for a DTensor parameter a DTensor of one row per shard (Note [8-bit DTensor state])."""
    if not hasattr(p, "device_mesh"):
        return scales
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = p.device_mesh
    sharded = [pl.is_shard() for pl in p.placements]
    shape = (*(mesh.size(j) if s else 1 for j, s in enumerate(sharded)), scales.numel())
    placements = [Shard(j) if s else Replicate() for j, s in enumerate(sharded)]
    local_rows = scales.view(*(1 for _ in sharded), scales.numel())
    return DTensor.from_local(local_rows, mesh, placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())  # fmt: skip


def _wrap_like(local_view: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """State for a DTensor parameter is a DTensor with the parameter's mesh and
    placements around the local slice; for a plain tensor it is the slice itself."""
    if not hasattr(p, "device_mesh"):
        return local_view
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local_view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def check_fused_param(p, gi: int, j: int, group=None, built: bool = True) -> None:
    """What the kernel needs of a parameter; a non-tensor is left to torch's own error.
    ``built=False`` (construction): a meta parameter is accepted, as torch's fused path
    does, so that an optimizer can be built before the model is materialized; the step
    checks the device."""
    if not isinstance(p, torch.Tensor):
        return
    where = f"param group {gi} parameter {j}"
    if p.dtype not in FUSED_DTYPES:
        raise ValueError(
            f"fused_step=True supports float32, float64, float16 and bfloat16 parameters; "
            f"{where} is {p.dtype}. Use fused_step=False for this group"
        )
    if group is not None and p.dtype == torch.float16 and group.get("stochastic_rounding"):
        raise ValueError(
            f"stochastic_rounding=True is implemented for bfloat16 parameters; {where} is "
            "float16. Use master_weights=True for float16 parameters"
        )
    if group is not None and p.dtype == torch.float64:
        check_precision(group, where, p.dtype)
    if group is not None and group.get("flat_grads"):
        check_flat_param(p, where)
    t = local(p)
    if t.is_meta and not built:
        return
    if t.is_meta:
        raise RuntimeError(
            f"{where} is on the meta device, which holds no values to step: materialize the "
            "model (e.g. model.to_empty(device=...) and initialize it) before optimizer.step()"
        )
    check_device(t.device, "ruda_torch.AdamW(fused_step=True)")


def check_precision(group: dict, where: str, dtype: torch.dtype) -> None:
    """Low-precision moments are for FP32, FP16 and BF16 parameters (FP64 ones keep FP64
    moments, Note [Parameter dtypes])."""
    precision = group.get("state_precision", "fp32")
    if precision != "fp32":
        raise ValueError(
            f"state_precision={precision!r} is for float32, float16 and bfloat16 parameters; "
            f"{where} is {dtype} (FP64 moments): use state_precision='fp32' for its group"
        )


def check_flat_param(p: torch.Tensor, where: str) -> None:
    """flat_grads=True makes ``p.grad`` a view of the bucket's buffer: for plain tensors
    and nn.Parameters, whose gradients autograd accumulates in place."""
    if getattr(p, "_is_flat_param", False):
        raise ValueError(
            f"flat_grads=True: {where} is an FSDP FlatParameter, whose gradient FSDP "
            "replaces after every reduce-scatter; it is already one flat gradient per FSDP "
            "unit, so flat_grads adds nothing: pass flat_grads=False (docs/usage.md)"
        )
    if hasattr(p, "device_mesh"):
        raise ValueError(
            f"flat_grads=True: {where} is a DTensor (FSDP2 / tensor parallel), whose gradient "
            "FSDP2 writes as a new sharded tensor at every backward; pass flat_grads=False "
            "(docs/usage.md)"
        )
    if type(p) not in (torch.Tensor, torch.nn.Parameter):
        raise ValueError(
            f"flat_grads=True takes torch.Tensor and nn.Parameter parameters; {where} is a "
            f"{type(p).__name__}. Use flat_grads=False for its group"
        )
    check_flat_grad_dtype(p, where)


def check_flat_grad_dtype(p: torch.Tensor, where: str) -> None:
    """A flat view holds a gradient in the parameter's dtype: a ``grad_dtype`` of its own
    (torch 2.13+) would refuse it. Checked at construction and, since torch lets a
    parameter whose gradient was cleared take another grad_dtype, before a step or
    zero_grad() puts a view back (Bucket.replaced_grads), before anything is written."""
    grad_dtype = getattr(p, "grad_dtype", p.dtype)
    if grad_dtype is not None and grad_dtype != p.dtype:
        raise ValueError(
            f"flat_grads=True: {where} ({p.dtype}) has grad_dtype={grad_dtype}, but the flat "
            "gradient buffer holds gradients in the parameters' dtype: pass flat_grads=False "
            "for its group (or set its grad_dtype to None or its dtype)"
        )


def check_group_options(group: dict, gi) -> None:
    """The param-group options of the fused path that depend on each other."""
    where = "" if gi is None else f" (param group {gi})"
    if group.get("master_weights") and group.get("stochastic_rounding"):
        raise ValueError(
            f"master_weights=True and stochastic_rounding=True exclude each other{where}: the "
            "master keeps the exact value, stochastic rounding is the way to go without one"
        )
    if (
        group.get("master_weights") or group.get("stochastic_rounding") or group.get("flat_grads")
    ) and not group.get("fused_step"):
        raise ValueError(
            f"master_weights, stochastic_rounding and flat_grads require fused_step=True{where} "
            "(they are options of the native fused path)"
        )
    precision = group.get("state_precision", "fp32")
    if precision not in STATE_PRECISIONS:
        raise ValueError(
            f"state_precision must be one of {STATE_PRECISIONS}{where}, got {precision!r}"
        )
    if precision != "fp32" and not group.get("fused_step"):
        raise ValueError(
            f"state_precision={precision!r} requires fused_step=True{where} (low-precision "
            "moments are stored and rounded by the native fused kernel)"
        )
    size = group.get("min_8bit_size", MIN_8BIT_SIZE)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(
            f"min_8bit_size must be a non-negative int{where} (parameters with fewer elements "
            f"keep FP32 moments under state_precision='8bit'), got {size!r}"
        )
    if group.get("state_rounding", "stochastic") not in ops.STATE_ROUNDINGS:
        raise ValueError(
            f"state_rounding must be one of {ops.STATE_ROUNDINGS}{where}, got "
            f"{group.get('state_rounding')!r}"
        )
    seed = group.get("rounding_seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"rounding_seed must be an int{where}, got {type(seed).__name__} {seed!r}")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(
            f"rounding_seed must be a 64-bit value (-2**63 <= seed < 2**64){where}, got {seed}: "
            "the kernels hash its 64 bits, so a larger value would be reduced silently"
        )


def check_bucket_options(group: dict, gi: int, buckets: list) -> None:
    """What check_fused_param checks of a group's options per parameter dtype, per bucket
    (one dtype each): run before every step, where the options may have changed."""
    if group.get("stochastic_rounding") and any(b.dtype == torch.float16 for b in buckets):
        raise ValueError(
            f"stochastic_rounding=True is implemented for bfloat16 parameters; param group "
            f"{gi} has float16 parameters. Use master_weights=True for float16 parameters"
        )
    if any(b.dtype == torch.float64 for b in buckets):
        check_precision(group, f"param group {gi}", torch.float64)


def check_no_duplicates(params: list, gi: int) -> None:
    """A step would update a listed-twice parameter twice: refused when the step's plan
    is made (torch.optim warns at construction, see AdamW.add_param_group)."""
    seen: dict[int, int] = {}
    for j, p in enumerate(params):
        first = seen.setdefault(id(p), j)
        if first != j:
            raise ValueError(
                f"param group {gi} lists the same parameter twice (positions {first} and {j}); "
                "fused_step=True steps each parameter once per step: remove the duplicate"
            )


class FusedPlan:
    """The buckets of every fused param group, and what they were derived from (Note
    [Fused state coherence])."""

    def __init__(self, groups: list[tuple[int, dict, list[Bucket]]]):
        self.groups = groups  # (group index, group dict, its buckets)
        self.buckets = [b for _, _, bs in groups for b in bs]
        self.spare: list[Bucket] = []  # buckets of groups out of param_groups (derive)

    def record(self, opt) -> None:
        """Remember what is_current() compares; called after every change that the
        optimizer itself makes to the state (derive, fresh state in a step)."""
        self._param_groups = opt.param_groups
        self._group_dicts = list(opt.param_groups)
        self._flags = [_flags(g) for g in opt.param_groups]
        self._state = opt.state
        containers = [opt.state]
        expected = [x for item in opt.state.items() for x in item]
        counts = [len(expected)]  # items of `expected` per container
        tensors, views = [], []
        for _, group, buckets in self.groups:
            containers.append(group["params"])
            expected.extend(group["params"])
            counts.append(len(group["params"]))
            for b in buckets:
                tensors.extend(b.params)
                for entry, mine in zip(b.entries, b.views, strict=True):
                    if entry is not None:
                        containers.append(entry)
                        expected.extend(x for item in entry.items() for x in item)
                        counts.append(2 * len(entry))
                        views.extend(v for v in mine.values() if type(v) is torch.Tensor)
        self._params_lists = [g["params"] for _, g, _ in self.groups]
        shapes = torch.tensor(_C.layout_record(tensors), dtype=torch.int64)
        facts = torch.tensor(_C.view_record(views), dtype=torch.int64)
        counts = torch.tensor(counts, dtype=torch.int64)
        self._check = (containers, counts, expected, tensors, shapes, views, facts)

    def is_current(self, opt) -> bool:
        groups = opt.param_groups
        if (
            opt.state is not self._state
            or len(groups) != len(self._group_dicts)
            or not all(map(_same, groups, self._group_dicts))
            or [_flags(g) for g in groups] != self._flags
            or not all(
                g["params"] is lst
                for (_, g, _), lst in zip(self.groups, self._params_lists, strict=True)
            )
        ):
            return False
        return _C.unchanged(*self._check)


def _flags(group: dict) -> tuple:
    return (
        bool(group.get("fused_step")),
        bool(group.get("amsgrad")),
        bool(group.get("master_weights")),
        bool(group.get("flat_grads")),
        group.get("state_precision", "fp32"),
        group.get("min_8bit_size", MIN_8BIT_SIZE),
    )


def split_group(opt, gi: int, group: dict, needs_global: bool) -> list:
    """The buckets' parameters of a fused group: (scope, moment precision, parameters,
    their positions) per device, dtype, scope and precision (Note [8-bit buckets]) (Note [Scopes]: one group may mix placements), in order of
    first appearance, after checking every parameter; writes nothing."""
    params = group["params"]
    check_group_options(group, gi)
    for j, p in enumerate(params):
        check_fused_param(p, gi, j, group)
        if opt.hierarchical_stats and p.dtype == torch.float64:
            raise ValueError(
                f"hierarchical_stats=True reads FP32, FP16 and BF16 gradients; param group {gi} "
                f"parameter {j} is float64 (FP64 gradients). Use max_grad_norm without "
                "hierarchical_stats for FP64 models"
            )
    check_no_duplicates(params, gi)
    by_key: dict = {}
    for j, p in enumerate(params):
        scope = scope_of(p, opt.process_group, needs_global, f"param group {gi} parameter {j}",
                         opt.partition_group)  # fmt: skip
        precision = bucket_precision(p, group)
        key = (local(p).device, p.dtype, scope, precision)
        by_key.setdefault(key, (scope, precision, [], []))
        by_key[key][2].append(p)
        by_key[key][3].append(j)
    return list(by_key.values())


def derive(opt, previous: FusedPlan | None, needs_global: bool) -> FusedPlan:
    """A plan for the current ``param_groups`` and ``state`` (Note [Fused state
    coherence]); validates everything before the first write."""
    state = opt.state
    kept: dict[tuple, Bucket] = {}
    if previous is not None:
        # The buckets of the previous plan, and those of groups that a swapped param_groups
        # left out (Note [Swapped param_groups] in optimizer.py): kept while a state entry
        # still holds their views, so they cost no memory the state does not hold anyway.
        for b in (*previous.spare, *previous.buckets):
            kept[tuple(map(id, b.params))] = b
    groups = []
    adopt = []  # (bucket, slot, parameter, entry, step counter, whether to view the maximum)
    forget = []  # (bucket, slot)
    reused: list[Bucket] = []
    owner: dict[int, int] = {}  # parameter id -> the fused group that lists it
    for gi, group in enumerate(opt.param_groups):
        if not group.get("fused_step"):
            continue
        for p in group["params"]:
            first = owner.setdefault(id(p), gi)
            if first != gi:
                raise ValueError(
                    f"a parameter appears in param groups {first} and {gi}; every parameter "
                    "belongs to one group (torch's add_param_group enforces this too)"
                )
        amsgrad = bool(group["amsgrad"])
        master = bool(group.get("master_weights"))
        flat = bool(group.get("flat_grads"))
        buckets = []
        for scope, precision, ps, js in split_group(opt, gi, group, needs_global):
            b = kept.pop(tuple(map(id, ps)), None)
            if b is not None and b.can_serve(ps, scope, amsgrad, master, flat, precision):
                reused.append(b)
            else:
                b = Bucket(ps, amsgrad, scope, master, flat, precision)
            buckets.append(b)
            for i, (p, j) in enumerate(zip(ps, js, strict=True)):
                where = f"optimizer.state of param group {gi} parameter {j}"
                entry = state.get(p)
                if not entry:
                    if b.views[i] is not None:
                        forget.append((b, i))
                    continue
                if b.owns(i, entry):
                    continue
                step = check_state_entry(entry, p, where)
                if not isinstance(entry, MutableMapping):
                    entry = dict(entry)
                with_max = amsgrad or moment_format(entry, "max_exp_avg_sq", where) is not None
                adopt.append((b, i, p, entry, step, with_max))
        groups.append((gi, group, buckets))

    # Commit: nothing above wrote anything.
    if not isinstance(state, defaultdict):  # a user's plain mapping: torch's code needs [] too
        state = opt.state = defaultdict(dict, state)
    kept_memory = {buf.untyped_storage().data_ptr() for b in reused for buf in b.buffers}
    staged = []
    for b, i, p, entry, step, with_max in adopt:
        values = {}
        for key in (*STATE_KEYS, *EIGHT_BIT_KEYS, MASTER_KEY):
            value = entry.get(key)
            if isinstance(value, torch.Tensor):
                value = local(value)
                if value.untyped_storage().data_ptr() in kept_memory:
                    value = value.clone()
                values[key] = value
        staged.append((b, i, p, entry, step, values, with_max))
    for b, i in forget:
        b.forget(i)
    for b, i, _, _, step, values, _ in staged:
        b.write_slot(i, step, values)
    # All new tensors first, one after another, then into the entries (whose old values
    # are freed there): Note [Tensors of their own] in csrc/module.cpp.
    made = [b.own_views(i, with_max) for b, i, _, _, _, _, with_max in staged]
    for (b, i, p, entry, _, _, _), views in zip(staged, made, strict=True):
        b.install(i, entry, views)
        if state.get(p) is not entry:
            state[p] = entry
    plan = FusedPlan(groups)
    plan.spare = [b for b in kept.values() if b.holds_state(state)]
    plan.record(opt)
    return plan
