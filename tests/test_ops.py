"""The native ``adamw_scaled_`` operator and the functional ``adamw_step``, on the CPU.

- Accuracy: every configuration x size x gradient dtype is stepped several times from
  a random state, and each step is compared with the FP64 reference
  (ruda_torch/reference.py) and with ``torch.optim.AdamW`` run in FP32 on the same
  inputs, with the tolerance table of tests/tolerances.py (our error at most a small
  multiple of torch's own, Note [Tolerance tied to torch's own error]).
- Buckets: several parameters sharing flat state buffers through ``slots``, inactive
  parameters untouched, per-parameter step counters; unaligned views; skip and clip
  control read from tensors; gradients never written; thread-count independence.
- Bad inputs: one table of broken calls with the expected message, and nothing changed.
- ``torch.library.opcheck``, the functional API, and the compiled-backend facts.

The kernels are shared with CUDA (csrc/adamw_math.h); tests/test_gpu_ops.py checks
CPU/CUDA bitwise parity when a GPU is present.
"""

from __future__ import annotations

import copy
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch
from threads import with_threads
from tolerances import TOLERANCES

import ruda_torch
from ruda_torch import ops
from ruda_torch.reference import adamw_reference

F32 = np.float32
GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# 0 (empty), 7 (leftover loop only), 97 and 1025 (8-wide vectors plus leftover), 65537
# (four full 16384-element CPU tiles and a one-element fifth). A 1-element tensor is in
# test_leftover_loop_matches_vector_path (bitwise) instead: the tolerance table scales
# errors by max|reference| over the tensor, which for a single element is that element,
# so an element that cancels (beta1 * m + (1 - beta1) * g near zero) fails or passes by
# the accident of each implementation's operation order (about 3% of random draws).
SIZES = [0, 7, 97, 1025, 65537]
N_STEPS = 3
QUANTITIES = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def seed_of(*parts) -> int:
    """A seed that is stable across processes (unlike hash() of a str)."""
    return zlib.crc32(repr(parts).encode())


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    if a is None or b is None:
        return a is None and b is None
    if a.layout != torch.strided or b.layout != torch.strided:
        return a.layout == b.layout and same_bits(a.to_dense(), b.to_dense())
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.device == b.device
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


# --------------------------------------------------------------- configurations table


@dataclass(frozen=True)
class Config:
    """One optimizer configuration; the defaults are ruda_torch's (docs/design.md section 1)."""

    id: str
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-5
    weight_decay: float = 1e-4
    amsgrad: bool = False
    maximize: bool = False
    gradient_scale: float = 1.0
    fresh: bool = False  # start from zero moments at step 0 instead of a random state

    def op_kwargs(self) -> dict:
        return dict(
            lr=self.lr,
            beta1=self.betas[0],
            beta2=self.betas[1],
            eps=self.eps,
            weight_decay=self.weight_decay,
            maximize=self.maximize,
        )

    def reference_kwargs(self) -> dict:
        return dict(
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
            amsgrad=self.amsgrad,
            maximize=self.maximize,
            gradient_scale=self.gradient_scale,
        )


CONFIGS = [
    Config("defaults_fresh", fresh=True),
    Config(
        "torch_like_scale_1024",
        lr=3e-3,
        betas=(0.9, 0.99),
        eps=1e-8,
        weight_decay=1e-2,
        gradient_scale=1024.0,
    ),
    Config("amsgrad", lr=1e-2, weight_decay=0.1, amsgrad=True),
    Config("maximize_scale_3", eps=1e-6, maximize=True, gradient_scale=3.0),
    Config(
        "amsgrad_maximize_scale_0.75",
        lr=0.05,
        betas=(0.8, 0.95),
        weight_decay=0.0,
        amsgrad=True,
        maximize=True,
        gradient_scale=0.75,
    ),
]


# ---------------------------------------------------------------------------- inputs


@dataclass
class State:
    """One implementation's FP32 state: parameter, moments, and the step count."""

    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None
    step: int

    def clone(self) -> State:
        return State(
            self.param.clone(),
            self.exp_avg.clone(),
            self.exp_avg_sq.clone(),
            None if self.max_exp_avg_sq is None else self.max_exp_avg_sq.clone(),
            self.step,
        )

    def get(self, name: str) -> torch.Tensor | None:
        return getattr(self, name)


def random_values(gen: torch.Generator, numel: int, low: float = -5.0, high: float = 0.0):
    """Normal values whose magnitudes spread over 10**low .. 10**high."""
    magnitude = torch.pow(10.0, torch.empty(numel).uniform_(low, high, generator=gen))
    return torch.randn(numel, generator=gen) * magnitude


def random_state(gen: torch.Generator, numel: int, cfg: Config) -> State:
    param = torch.randn(numel, generator=gen)
    if cfg.fresh:
        zeros = torch.zeros(numel)
        return State(param, zeros, zeros.clone(), zeros.clone() if cfg.amsgrad else None, 0)
    exp_avg = random_values(gen, numel) * 0.1
    exp_avg_sq = random_values(gen, numel) ** 2 + 1e-12
    max_sq = None
    if cfg.amsgrad:  # above v for some elements, below for others
        max_sq = exp_avg_sq * torch.empty(numel).uniform_(0.5, 1.5, generator=gen)
    step = int(torch.randint(1, 50, (), generator=gen))
    return State(param, exp_avg, exp_avg_sq, max_sq, step)


def stored_grad(gen: torch.Generator, numel: int, dtype: torch.dtype, scale: float):
    """A gradient as a loss scaler stores it: the unscaled values times `scale`, in
    `dtype` (FP16 values below 6e-5 are subnormal: the kernel must convert them exactly)."""
    return (random_values(gen, numel) * scale).to(dtype)


def torch_input_grad(stored: torch.Tensor, scale: float, clip: float = 1.0) -> torch.Tensor:
    """What torch.optim.AdamW sees in a GradScaler + clip_grad_norm_ pipeline: the stored
    gradient converted exactly to FP32, multiplied by fp32(1 / scale) (GradScaler's
    unscale), then by the FP32 clip coefficient."""
    inv = torch.tensor(1.0 / scale, dtype=torch.float64).float()
    g = stored.to(torch.float32) * inv
    if clip != 1.0:
        g = g * torch.tensor(clip, dtype=torch.float32)
    return g


class TorchAdamW:
    """torch.optim.AdamW (single-tensor FP32 path) on one parameter, from a given state."""

    def __init__(self, state: State, cfg: Config):
        self.param = torch.nn.Parameter(state.param.clone())
        self.opt = torch.optim.AdamW(
            [self.param],
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            amsgrad=cfg.amsgrad,
            maximize=cfg.maximize,
            foreach=False,
        )
        st = {
            "step": torch.tensor(float(state.step)),
            "exp_avg": state.exp_avg.clone(),
            "exp_avg_sq": state.exp_avg_sq.clone(),
        }
        if cfg.amsgrad:
            st["max_exp_avg_sq"] = state.max_exp_avg_sq.clone()
        self.opt.state[self.param] = st

    def state(self) -> State:
        st = self.opt.state[self.param]
        return State(
            self.param.detach().clone(),
            st["exp_avg"].clone(),
            st["exp_avg_sq"].clone(),
            st["max_exp_avg_sq"].clone() if "max_exp_avg_sq" in st else None,
            int(st["step"].item()),
        )

    def step(self, grad: torch.Tensor) -> None:
        self.param.grad = grad.clone()
        self.opt.step()


def reference_step(state: State, grad: torch.Tensor, cfg: Config, clip: float = 1.0) -> State:
    p, m, v, vm, t = adamw_reference(
        state.param,
        grad,
        state.exp_avg,
        state.exp_avg_sq,
        state.max_exp_avg_sq,
        state.step,
        clip_coef=clip,
        **cfg.reference_kwargs(),
    )
    return State(p, m, v, vm, int(t.item()))


def native_step(state: State, grad: torch.Tensor, cfg: Config, **control) -> State:
    """One adamw_scaled_ call on a copy of `state` (one parameter, slot (0, 0))."""
    out = state.clone()
    device = state.param.device
    steps = torch.tensor([float(state.step)], device=device)
    scale = None
    if cfg.gradient_scale != 1.0:
        scale = torch.tensor([cfg.gradient_scale], dtype=torch.float32, device=device)
    ops.adamw_scaled_(
        [out.param],
        [grad],
        out.exp_avg.view(-1),
        out.exp_avg_sq.view(-1),
        None if out.max_exp_avg_sq is None else out.max_exp_avg_sq.view(-1),
        steps,
        torch.zeros(1, 2, dtype=torch.int64),
        grad_scale=scale,
        **cfg.op_kwargs(),
        **control,
    )
    assert steps.item() == float(int(steps.item())), "step counter is not an integer"
    out.step = int(steps.item())
    return out


def check_against(
    ours: State,
    ours_ref: State,
    theirs: State,
    theirs_ref: State | None,
    kind: str,
    what: str,
) -> None:
    """Each quantity through its row of the tolerance table ("one_step" or "chain"),
    flattened (the errors are per element either way)."""

    def flat(state: State | None, name: str):
        t = None if state is None else state.get(name)
        return None if t is None else t.reshape(-1)

    for name in QUANTITIES:
        if ours.get(name) is None:
            assert ours_ref.get(name) is None and theirs.get(name) is None, name
            continue
        TOLERANCES[f"{kind}.{name}"].check(
            flat(ours, name),
            flat(ours_ref, name),
            flat(theirs, name),
            torch_reference=flat(theirs_ref, name),
            what=f"{what} {name}",
        )


# ------------------------------------------------------------------ accuracy vs FP64


# Every configuration x size x gradient dtype, except that the largest size takes one
# dtype per configuration (in turn): its extra tiles change no arithmetic (that is
# test_leftover_loop_matches_vector_path's bitwise claim), only the test's run time.
ACCURACY_CASES = [
    pytest.param(cfg, numel, dtype, id=f"{cfg.id}-{numel}-{dtype_id}")
    for cfg in CONFIGS
    for numel in SIZES[:-1]
    for dtype, dtype_id in zip(GRAD_DTYPES, DTYPE_IDS, strict=True)
] + [
    pytest.param(cfg, SIZES[-1], GRAD_DTYPES[i % 3], id=f"{cfg.id}-{SIZES[-1]}-{DTYPE_IDS[i % 3]}")
    for i, cfg in enumerate(CONFIGS)
]


@pytest.mark.parametrize("cfg,numel,grad_dtype", ACCURACY_CASES)
def test_matches_fp64_reference_and_torch(cfg, numel, grad_dtype):
    gen = torch.Generator().manual_seed(seed_of(cfg.id, numel, str(grad_dtype)))
    start = random_state(gen, numel, cfg)
    ours, chain = start.clone(), start.clone()
    theirs = TorchAdamW(start, cfg)
    for k in range(N_STEPS):
        grad = stored_grad(gen, numel, grad_dtype, cfg.gradient_scale)
        grad_before = grad.clone()
        torch_before = theirs.state()

        ours_ref = reference_step(ours, grad, cfg)
        ours = native_step(ours, grad, cfg)
        assert same_bits(grad, grad_before), "adamw_scaled_ wrote the gradient"
        theirs.step(torch_input_grad(grad, cfg.gradient_scale))
        theirs_ref = reference_step(torch_before, grad, cfg)
        chain = reference_step(chain, grad, cfg)

        torch_after = theirs.state()
        assert ours.step == torch_after.step == start.step + k + 1
        check_against(ours, ours_ref, torch_after, theirs_ref, "one_step", f"step {k + 1}")
    check_against(ours, chain, torch_after, None, "chain", f"after {N_STEPS} steps")


LEFTOVER_SLICES = [
    # (offset, length) inside a 65545-element tensor updated as a whole
    (0, 1),  # scalar path alone; vector path in the whole
    (3, 7),
    (8, 97),  # 96 vector elements and one scalar one; all vector in the whole
    (1, 1025),
    (16384 - 3, 7),  # across the first CPU tile boundary of the whole
    (65536, 9),  # the whole's last tile, partly its leftover loop
    (0, 65537),
]


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cfg", [CONFIGS[1], CONFIGS[4]], ids=[CONFIGS[1].id, CONFIGS[4].id])
def test_leftover_loop_matches_vector_path(cfg, grad_dtype):
    # Note [One math, two backends]: the scalar leftover loop and the 8-wide vector loop
    # run the same adamw_element(), so any element gives the same bits whichever path
    # (and whichever tile) it goes through. A slice updated on its own must therefore
    # equal the same elements of a larger tensor updated as a whole.
    gen = torch.Generator().manual_seed(seed_of("leftover", cfg.id, str(grad_dtype)))
    n = 65545
    start = random_state(gen, n, cfg)
    grads = [stored_grad(gen, n, grad_dtype, cfg.gradient_scale) for _ in range(2)]
    whole = start
    for g in grads:
        whole = native_step(whole, g, cfg)
    for offset, length in LEFTOVER_SLICES:

        def piece(t, offset=offset, length=length):
            return None if t is None else t[offset : offset + length].clone()

        part = State(*(piece(start.get(q)) for q in QUANTITIES), start.step)
        for g in grads:
            part = native_step(part, piece(g), cfg)
        for name in QUANTITIES:
            assert same_bits(part.get(name), piece(whole.get(name))), (
                f"{name} of elements [{offset}, {offset + length}) alone differs from the "
                "same elements updated in the whole tensor"
            )


def test_bias_correction_uses_each_step():
    # Two steps with the same inputs and only the step counter different must differ
    # exactly as the FP64 reference says (a kernel that ignored the counter would not).
    cfg = Config("bias", betas=(0.5, 0.6), weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    start = random_state(gen, 97, cfg)
    grad = stored_grad(gen, 97, torch.float32, 1.0)
    results = {}
    for step in (0, 1, 7):
        state = replace(start.clone(), step=step)
        ours = native_step(state, grad, cfg)
        ref = reference_step(state, grad, cfg)
        theirs = TorchAdamW(state, cfg)
        theirs.step(grad)
        check_against(ours, ref, theirs.state(), None, "one_step", f"from step {step}")
        results[step] = ours.param
    assert not torch.equal(results[0], results[1])
    assert not torch.equal(results[1], results[7])


# ----------------------------------------------------------------------------- buckets


@dataclass
class Bucket:
    """Parameters sharing flat state buffers; slots[i] = (state offset, step index)."""

    params: list[torch.Tensor]
    offsets: list[int]
    step_ids: list[int]
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None
    steps: torch.Tensor

    def slots(self, active: list[int]) -> torch.Tensor:
        return torch.tensor(
            [[self.offsets[i], self.step_ids[i]] for i in active], dtype=torch.int64
        ).reshape(-1, 2)

    def state_of(self, i: int) -> State:
        def piece(buf):
            if buf is None:
                return None
            n = self.params[i].numel()
            return buf[self.offsets[i] : self.offsets[i] + n].view_as(self.params[i])

        return State(
            self.params[i],
            piece(self.exp_avg),
            piece(self.exp_avg_sq),
            piece(self.max_exp_avg_sq),
            int(self.steps[self.step_ids[i]].item()),
        )

    def written(self) -> list[torch.Tensor]:
        bufs = [self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq, self.steps]
        return [*self.params, *(b for b in bufs if b is not None)]


def make_bucket(
    gen: torch.Generator, shapes: list[tuple], amsgrad: bool, align: int | None = None
) -> Bucket:
    """Slices in a shuffled order with 3-element gaps between them (or, with ``align``,
    each starting on a multiple of ``align`` elements, as the optimizer lays them out),
    step counters in a shuffled order with unused counters, every buffer filled with
    random values."""
    n = len(shapes)
    params = [torch.randn(s, generator=gen) for s in shapes]
    order = torch.randperm(n, generator=gen).tolist()
    offsets = [0] * n
    cursor = 3 if align is None else 0
    for i in order:
        offsets[i] = cursor
        cursor += params[i].numel() + 3
        if align is not None:
            cursor = -(-cursor // align) * align
    step_ids = torch.randperm(n + 2, generator=gen)[:n].tolist()
    exp_avg = random_values(gen, cursor) * 0.1
    exp_avg_sq = random_values(gen, cursor) ** 2 + 1e-12
    max_sq = exp_avg_sq * torch.empty(cursor).uniform_(0.5, 1.5, generator=gen) if amsgrad else None
    steps = torch.randint(0, 100, (n + 2,), generator=gen).float()
    return Bucket(params, offsets, step_ids, exp_avg, exp_avg_sq, max_sq, steps)


BUCKET_SHAPES = [(7, 13), (0,), (1,), (97,), (16384,), (1025,), (0, 4), (16385,), (33,)]
INACTIVE = {2, 5, 6}  # not passed to the call: no gradient this step


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=DTYPE_IDS)
def test_bucket_shared_state_and_inactive_params(grad_dtype, amsgrad):
    cfg = Config("bucket", lr=1e-2, weight_decay=0.05, amsgrad=amsgrad, gradient_scale=3.0)
    gen = torch.Generator().manual_seed(seed_of("bucket", str(grad_dtype), amsgrad))
    bucket = make_bucket(gen, BUCKET_SHAPES, amsgrad)
    active = [i for i in range(len(BUCKET_SHAPES)) if i not in INACTIVE]
    grads = {i: stored_grad(gen, bucket.params[i].numel(), grad_dtype, 3.0) for i in active}
    grads = {i: g.view(bucket.params[i].shape) for i, g in grads.items()}
    assert len({int(bucket.steps[bucket.step_ids[i]]) for i in active}) > 1

    before = [t.clone() for t in bucket.written()]
    state_before = {i: bucket.state_of(i).clone() for i in range(len(BUCKET_SHAPES))}
    # Each active parameter alone, on copies: the bucket must give the same bits.
    alone = {i: native_step(state_before[i], grads[i], cfg) for i in active}
    for k in range(2):  # a second call checks that the first advanced each counter
        ops.adamw_scaled_(
            [bucket.params[i] for i in active],
            [grads[i] for i in active],
            bucket.exp_avg,
            bucket.exp_avg_sq,
            bucket.max_exp_avg_sq,
            bucket.steps,
            bucket.slots(active),
            grad_scale=torch.tensor([3.0]),
            **cfg.op_kwargs(),
        )
        if k == 0:
            for i in active:
                got = bucket.state_of(i)
                assert got.step == state_before[i].step + 1, f"params[{i}] step"
                for name in QUANTITIES:
                    assert same_bits(got.get(name), alone[i].get(name)), f"params[{i}] {name}"
                # The per-parameter bias correction, against the FP64 reference.
                ref = reference_step(state_before[i], grads[i], cfg)
                theirs = TorchAdamW(state_before[i], cfg)
                theirs.step(torch_input_grad(grads[i], 3.0))
                check_against(got, ref, theirs.state(), None, "one_step", f"params[{i}]")

    # Inactive parameters, their slices, the gaps and the unused counters: untouched.
    written_mask = {
        name: torch.zeros(buf.numel(), dtype=torch.bool)
        for name, buf in (("exp_avg", bucket.exp_avg), ("exp_avg_sq", bucket.exp_avg_sq))
    }
    for i in active:
        for mask in written_mask.values():
            mask[bucket.offsets[i] : bucket.offsets[i] + bucket.params[i].numel()] = True
    n = len(BUCKET_SHAPES)
    for i in INACTIVE:
        assert same_bits(bucket.params[i], before[i]), f"inactive params[{i}] changed"
    for j, name in enumerate(["exp_avg", "exp_avg_sq"]):
        untouched = ~written_mask[name]
        assert same_bits(getattr(bucket, name)[untouched], before[n + j][untouched]), name
    if amsgrad:
        untouched = ~written_mask["exp_avg"]
        assert same_bits(bucket.max_exp_avg_sq[untouched], before[n + 2][untouched])
    active_ids = {bucket.step_ids[i] for i in active}
    for s in range(bucket.steps.numel()):
        expected = before[-1][s] + (2 if s in active_ids else 0)
        assert bucket.steps[s].item() == expected.item(), f"steps[{s}]"


def test_bucket_without_params_changes_nothing():
    bucket = make_bucket(torch.Generator().manual_seed(2), [(5,)], amsgrad=True)
    before = [t.clone() for t in bucket.written()]
    ops.adamw_scaled_(
        [],
        [],
        bucket.exp_avg,
        bucket.exp_avg_sq,
        bucket.max_exp_avg_sq,
        bucket.steps,
        torch.zeros(0, 2, dtype=torch.int64),
        **Config("empty").op_kwargs(),
    )
    for a, b in zip(before, bucket.written(), strict=True):
        assert same_bits(a, b)


# ---------------------------------------------------------------------- unaligned views


def odd_view(values: torch.Tensor, offset: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of `values` at element `offset` of a larger buffer (with sentinels around
    it), so that its address is not 16-byte aligned. Returns (view, whole buffer)."""
    base = torch.full(
        (values.numel() + offset + 2,), -7.0, dtype=values.dtype, device=values.device
    )
    view = base[offset : offset + values.numel()]
    view.copy_(values.reshape(-1))
    if values.numel() > 0:
        assert view.data_ptr() % 16 != 0
    return view.view(values.shape), base


UNALIGNED_CASES = [
    pytest.param(numel, dtype, id=f"{numel}-{dtype_id}")
    for numel in (97, 1025)
    for dtype, dtype_id in zip(GRAD_DTYPES, DTYPE_IDS, strict=True)
] + [pytest.param(65537, torch.float16, id="65537-fp16")]


@pytest.mark.parametrize("numel,grad_dtype", UNALIGNED_CASES)
def test_unaligned_views_give_the_aligned_bits(numel, grad_dtype):
    cfg = Config("unaligned", amsgrad=True, maximize=True, gradient_scale=3.0)
    gen = torch.Generator().manual_seed(seed_of("unaligned", numel, str(grad_dtype)))
    start = random_state(gen, numel, cfg)
    grads = [stored_grad(gen, numel, grad_dtype, 3.0) for _ in range(N_STEPS)]

    aligned = start.clone()
    for g in grads:
        aligned = native_step(aligned, g.clone(), cfg)

    p, p_base = odd_view(start.param, 1)
    m, m_base = odd_view(start.exp_avg, 3)
    v, v_base = odd_view(start.exp_avg_sq, 1)
    vm, vm_base = odd_view(start.max_exp_avg_sq, 2)
    steps, steps_base = odd_view(torch.tensor([float(start.step)]), 1)
    bases = [p_base, m_base, v_base, vm_base, steps_base]
    sentinels = [b.clone() for b in bases]
    for g in grads:
        g_view, _ = odd_view(g, 1)  # 2-byte offset for FP16/BF16, 4 bytes for FP32
        ops.adamw_scaled_(
            [p],
            [g_view],
            m,
            v,
            vm,
            steps,
            torch.zeros(1, 2, dtype=torch.int64),
            grad_scale=torch.tensor([3.0]),
            **cfg.op_kwargs(),
        )
    got = State(p, m, v, vm, int(steps.item()))
    for name in QUANTITIES:
        assert same_bits(got.get(name), aligned.get(name)), name
    assert got.step == aligned.step
    for base, saved, view in zip(bases, sentinels, [p, m, v, vm, steps], strict=True):
        outside = torch.ones(base.numel(), dtype=torch.bool)
        offset = view.storage_offset()
        outside[offset : offset + view.numel()] = False
        assert same_bits(base[outside], saved[outside]), "wrote outside the view"


# ------------------------------------------------------------------- skip and clipping


def _skip_bucket(gen: torch.Generator) -> tuple[Bucket, dict]:
    bucket = make_bucket(gen, [(1025,), (7,), (0,)], amsgrad=True)
    grads = [stored_grad(gen, p.numel(), torch.float16, 512.0) for p in bucket.params]
    return bucket, dict(
        params=bucket.params,
        grads=grads,
        slots=bucket.slots([0, 1, 2]),
        grad_scale=torch.tensor([512.0]),
    )


def _run_bucket(bucket: Bucket, args: dict, cfg: Config, **control) -> None:
    ops.adamw_scaled_(
        args["params"],
        args["grads"],
        bucket.exp_avg,
        bucket.exp_avg_sq,
        bucket.max_exp_avg_sq,
        bucket.steps,
        args["slots"],
        grad_scale=args["grad_scale"],
        **cfg.op_kwargs(),
        **control,
    )


SKIP_CASES = [
    # (id, control arguments, skipped?)
    ("found_inf_0d_one", lambda: dict(found_inf=torch.tensor(1.0)), True),
    ("found_inf_1d_one", lambda: dict(found_inf=torch.tensor([1.0])), True),
    ("found_inf_0d_two", lambda: dict(found_inf=torch.tensor(2.0)), True),
    ("found_inf_1d_two", lambda: dict(found_inf=torch.tensor([2.0])), True),
    ("found_inf_nan", lambda: dict(found_inf=torch.tensor([math.nan])), True),
    ("found_inf_0d_zero", lambda: dict(found_inf=torch.tensor(0.0)), False),
    ("found_inf_1d_zero", lambda: dict(found_inf=torch.tensor([0.0])), False),
    ("found_inf_negative_zero", lambda: dict(found_inf=torch.tensor([-0.0])), False),
    ("stats_nonfinite", lambda: dict(stats=torch.tensor([4.0, 1.0, 1.0])), True),
    (
        "stats_nonfinite_with_clip",
        lambda: dict(stats=torch.tensor([4.0, 1.0, 3.0]), max_grad_norm=1.0),
        True,
    ),
    ("stats_finite_no_max_norm", lambda: dict(stats=torch.tensor([4.0, 1.0, 0.0])), False),
    (
        "found_inf_with_finite_stats",
        lambda: dict(found_inf=torch.tensor([1.0]), stats=torch.tensor([4.0, 1.0, 0.0])),
        True,
    ),
    (
        "stats_nonfinite_found_inf_zero",
        lambda: dict(found_inf=torch.tensor([0.0]), stats=torch.tensor([4.0, 1.0, 2.0])),
        True,
    ),
]


@pytest.mark.parametrize(
    "control,skipped", [c[1:] for c in SKIP_CASES], ids=[c[0] for c in SKIP_CASES]
)
def test_skip_control(control, skipped):
    cfg = Config("skip", amsgrad=True)
    bucket, args = _skip_bucket(torch.Generator().manual_seed(4))
    plain, _ = _skip_bucket(torch.Generator().manual_seed(4))
    before = [t.clone() for t in bucket.written()]
    grads_before = [g.clone() for g in args["grads"]]
    control = control()
    control_before = {k: v.clone() for k, v in control.items() if isinstance(v, torch.Tensor)}
    _run_bucket(bucket, args, cfg, **control)
    if skipped:
        expected = before  # everything bit-identical, step counters included
    else:
        _run_bucket(plain, dict(args, params=plain.params), cfg)
        expected = plain.written()
        assert not same_bits(before[0], bucket.params[0]), "the step did not update"
    for i, (a, b) in enumerate(zip(expected, bucket.written(), strict=True)):
        assert same_bits(a, b), f"written tensor {i}"
    for a, b in zip(grads_before, args["grads"], strict=True):
        assert same_bits(a, b)
    for k, v in control_before.items():
        assert same_bits(v, control[k]), f"{k} was written"


def clip_coefficient_fp32(sum_sq: float, max_norm: float) -> np.float32:
    """min(1, max_norm / (sqrt(sum_sq) + 1e-6)), each operation in FP32 (clip_grad_norm_)."""
    coef = F32(max_norm) / (np.sqrt(F32(sum_sq)) + F32(1e-6))
    return min(coef, F32(1.0))


CLIP_CASES = [
    # (id, stats sum_of_squares, max_grad_norm, gradient_scale)
    ("norm_4_max_1", 16.0, 1.0, 1.0),
    ("scaled_pow2", 2.5e3, 3.0, 1024.0),
    ("scaled_3", 7.3, 0.5, 3.0),
    ("norm_exactly_max", 1.0, 1.0, 1.0),  # 1 / (1 + 1e-6): clips, barely
    ("norm_below_max", 0.25, 1.0, 1.0),  # coefficient 1: no clipping
]


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize(
    "sum_sq,max_norm,scale", [c[1:] for c in CLIP_CASES], ids=[c[0] for c in CLIP_CASES]
)
def test_clip_from_stats(sum_sq, max_norm, scale, amsgrad):
    cfg = Config("clip", amsgrad=amsgrad, maximize=amsgrad, gradient_scale=scale)
    gen = torch.Generator().manual_seed(seed_of("clip", sum_sq, max_norm, scale, amsgrad))
    start = random_state(gen, 1025, cfg)
    grad = stored_grad(gen, 1025, torch.bfloat16, scale)
    coef = clip_coefficient_fp32(sum_sq, max_norm)

    from_stats = native_step(
        start, grad, cfg, stats=torch.tensor([sum_sq, 1.0, 0.0]), max_grad_norm=max_norm
    )
    from_tensor = native_step(start, grad, cfg, clip_coef=torch.tensor([float(coef)]))
    unclipped = native_step(start, grad, cfg)
    for name in QUANTITIES:
        assert same_bits(from_stats.get(name), from_tensor.get(name)), name
        if coef == 1.0:
            assert same_bits(from_stats.get(name), unclipped.get(name)), name
    if coef < 1.0:
        assert not torch.equal(from_stats.param, unclipped.param)
    ref = reference_step(start, grad, cfg, clip=float(coef))
    theirs = TorchAdamW(start, cfg)
    theirs.step(torch_input_grad(grad, scale, float(coef)))
    check_against(from_stats, ref, theirs.state(), None, "one_step", f"clip {coef}")


@pytest.mark.parametrize("coef", [0.25, 0.3, 1.0, 2.5])
def test_clip_coef_tensor(coef):
    cfg = Config("clip_coef", gradient_scale=2.0)
    gen = torch.Generator().manual_seed(seed_of("clip_coef", coef))
    start = random_state(gen, 97, cfg)
    grad = stored_grad(gen, 97, torch.float32, 2.0)
    coef_t = torch.tensor([coef])
    saved = coef_t.clone()
    ours = native_step(start, grad, cfg, clip_coef=coef_t)
    assert same_bits(coef_t, saved)
    coef32 = coef_t.item()  # the FP32 value the kernel reads
    ref = reference_step(start, grad, cfg, clip=coef32)
    theirs = TorchAdamW(start, cfg)
    theirs.step(torch_input_grad(grad, 2.0, coef32))
    check_against(ours, ref, theirs.state(), None, "one_step", f"clip_coef {coef}")


@pytest.mark.parametrize("maximize", [False, True])
def test_clip_coef_float64_for_float64_parameters(maximize):
    """FP64 parameters take an FP64 clip_coef (clip_grad_norm_'s, not rounded to FP32):
    the step is, bit for bit, the unclipped step on gradients multiplied by it in FP64."""
    gen = torch.Generator().manual_seed(9)
    coef = 0.1 + 2.0**-40  # no FP32 value
    sizes = [97, 1025]
    params = [torch.randn(n, generator=gen, dtype=torch.float64) for n in sizes]
    grads = [torch.randn(n, generator=gen, dtype=torch.float64) for n in sizes]

    def run(grads, clip):
        ps = [p.clone() for p in params]
        total = sum(sizes)
        m = torch.randn(total, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        v = torch.rand(total, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        steps = torch.tensor([2.0, 5.0])
        slots = torch.tensor([[0, 0], [97, 1]])
        ops.adamw_scaled_(ps, grads, m, v, None, steps, slots, lr=1e-2, beta1=0.9,
                          beta2=0.999, eps=1e-8, weight_decay=1e-2, maximize=maximize,
                          clip_coef=clip)  # fmt: skip
        return ps, m, v

    clipped = run(grads, torch.tensor([coef], dtype=torch.float64))
    premultiplied = run([g * coef for g in grads], None)
    for a, b in zip(clipped, premultiplied, strict=True):
        for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b],
                        strict=True):  # fmt: skip
            assert same_bits(x, y)
    rounded = run(grads, torch.tensor([coef], dtype=torch.float32))
    assert not same_bits(rounded[1], clipped[1])  # FP32 would clip by another number


# --------------------------------------------------------- gradients and thread counts


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=DTYPE_IDS)
def test_gradients_never_written(grad_dtype):
    cfg = Config("grads", amsgrad=True, maximize=True, gradient_scale=3.0)
    gen = torch.Generator().manual_seed(seed_of("grads", str(grad_dtype)))
    bucket = make_bucket(gen, [(65537,), (5, 5), (0,)], amsgrad=True)
    grads = [stored_grad(gen, p.numel(), grad_dtype, 3.0).view(p.shape) for p in bucket.params]
    saved = [g.clone() for g in grads]
    _run_bucket(
        bucket,
        dict(
            params=bucket.params,
            grads=grads,
            slots=bucket.slots([0, 1, 2]),
            grad_scale=torch.tensor([3.0]),
        ),
        cfg,
        stats=torch.tensor([100.0, 1.0, 0.0]),
        max_grad_norm=1.0,
    )
    for a, b in zip(saved, grads, strict=True):
        assert same_bits(a, b)


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=DTYPE_IDS)
def test_thread_count_independent(grad_dtype):
    cfg = Config("threads", amsgrad=True, gradient_scale=3.0)
    shapes = [(3 * 16384 + 5,), (16384,), (7,), (40000,)]

    # The inputs are made once: torch's own pointwise kernels (pow in random_values) may
    # round differently at their thread-chunk boundaries.
    gen = torch.Generator().manual_seed(seed_of("threads", str(grad_dtype)))
    start = make_bucket(gen, shapes, amsgrad=True)
    grads = [stored_grad(gen, p.numel(), grad_dtype, 3.0) for p in start.params]

    def run():
        bucket = copy.deepcopy(start)
        args = dict(
            params=bucket.params,
            grads=grads,
            slots=bucket.slots([0, 1, 2, 3]),
            grad_scale=torch.tensor([3.0]),
        )
        for _ in range(2):
            _run_bucket(bucket, args, cfg)
        return bucket.written()

    one = with_threads(1, run)
    two = with_threads(2, run)
    assert torch.get_num_threads() >= 1
    for i, (a, b) in enumerate(zip(one, two, strict=True)):
        assert same_bits(a, b), f"written tensor {i} depends on the thread count"


# --------------------------------------------------------------------------- bad inputs


@dataclass
class Call:
    """A valid adamw_scaled_ call over three parameters; rows of BAD_INPUTS break it."""

    params: list[torch.Tensor] = field(
        default_factory=lambda: [torch.randn(5), torch.randn(7), torch.randn(2, 3)]
    )
    grads: list[torch.Tensor] = field(
        default_factory=lambda: [torch.randn(5), torch.randn(7), torch.randn(2, 3)]
    )
    exp_avg: torch.Tensor = field(default_factory=lambda: torch.randn(20))
    exp_avg_sq: torch.Tensor = field(default_factory=lambda: torch.rand(20))
    max_exp_avg_sq: torch.Tensor | None = field(default_factory=lambda: torch.rand(20))
    steps: torch.Tensor = field(default_factory=lambda: torch.tensor([3.0, 5.0, 1.0, 9.0]))
    slots: torch.Tensor = field(default_factory=lambda: torch.tensor([[0, 0], [5, 1], [14, 3]]))
    kwargs: dict = field(
        default_factory=lambda: dict(
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=1e-2,
            grad_scale=torch.tensor([2.0]),
            found_inf=torch.tensor([0.0]),
        )
    )

    def run(self, op=ops.adamw_scaled_) -> None:
        op(
            self.params,
            self.grads,
            self.exp_avg,
            self.exp_avg_sq,
            self.max_exp_avg_sq,
            self.steps,
            self.slots,
            **self.kwargs,
        )

    def tensors(self) -> list[torch.Tensor]:
        out = [*self.params, *self.grads, self.exp_avg, self.exp_avg_sq, self.steps, self.slots]
        out += [t for t in (self.max_exp_avg_sq,) if t is not None]
        return out + [v for v in self.kwargs.values() if isinstance(v, torch.Tensor)]


def _replace(i: int, value):
    """A copy of a list with item i replaced (value: a function of the old item)."""

    def apply(items):
        items = list(items)
        items[i] = value(items[i])
        return items

    return apply


def _slot(row: int, col: int, value: int):
    def apply(slots):
        slots = slots.clone()
        slots[row, col] = value
        return slots

    return apply


def _kw(**changes):
    def apply(c: Call):
        c.kwargs = {**c.kwargs, **{k: v() if callable(v) else v for k, v in changes.items()}}

    return apply


def _set(name: str, fn: Callable):
    def apply(c: Call):
        setattr(c, name, fn(getattr(c, name)))

    return apply


def _params_overlap(c: Call):
    base = torch.randn(12)
    c.params = [base[0:5], base[3:10], c.params[2]]


BAD_INPUTS = [
    # (id, how to break the valid call, expected message)
    ("grads_length", _set("grads", lambda g: g[:2]), r"grads has 2 tensors but params has 3"),
    (
        "grad_shape",
        _set("grads", _replace(1, lambda g: g.view(1, 7))),
        r"grads\[1\] must have the same shape as params\[1\] \(got \[1, 7\] vs \[7\]\)",
    ),
    (
        "param_float64_among_float32",
        _set("params", _replace(1, lambda p: p.double())),
        r"params\[1\] is float64 but params\[0\] is float32; one call takes one parameter dtype",
    ),
    (
        "param_float16_among_float32",
        _set("params", _replace(1, lambda p: p.half())),
        r"params\[1\] is float16 but params\[0\] is float32",
    ),
    (
        "param_int",
        _set("params", lambda ps: [p.to(torch.int32) for p in ps]),
        r"params\[0\] must be float32, float64, float16 or bfloat16 \(got Int\)",
    ),
    (
        "params_float64_with_float32_state",
        _set("params", lambda ps: [p.double() for p in ps]),
        r"exp_avg must be float64 \(got float32\)",
    ),
    (
        "grad_float64",
        _set("grads", lambda gs: [g.double() for g in gs]),
        r"grads\[0\] is float64; float32 parameters take float32, float16 or bfloat16 gradients",
    ),
    (
        "bf16_params_fp16_grads",
        lambda c: (
            setattr(c, "params", [p.bfloat16() for p in c.params]),
            setattr(c, "grads", [g.half() for g in c.grads]),
        ),
        r"grads\[0\] is float16; bfloat16 parameters take bfloat16 or float32 gradients",
    ),
    (
        "mixed_grad_dtypes",
        _set("grads", _replace(2, lambda g: g.bfloat16())),
        r"grads\[2\] is BFloat16 but grads\[0\] is Float; one call takes one gradient dtype",
    ),
    (
        "param_not_dense",
        _set("params", _replace(2, lambda p: torch.randn(2, 6)[:, ::2])),
        r"params\[2\] must be dense \(contiguous, or a permutation of a contiguous tensor; got "
        r"shape \[2, 3\] with strides \[6, 2\]\)",
    ),
    (
        "grad_not_dense",
        _set("grads", _replace(2, lambda g: torch.randn(2, 6)[:, ::2])),
        r"grads\[2\] must be dense",
    ),
    (
        "grad_layout_differs",
        _set("grads", _replace(2, lambda g: torch.randn(3, 2).t())),
        r"grads\[2\] must lay its elements out in memory as params\[2\] does \(strides "
        r"\[1, 2\] vs \[3, 1\]\)",
    ),
    (
        "master_for_float32_params",
        _kw(master=lambda: torch.zeros(20)),
        r"master weights are for float16 and bfloat16 parameters; params are float32",
    ),
    (
        "master_wrong_size",
        lambda c: (
            setattr(c, "params", [p.bfloat16() for p in c.params]),
            _kw(master=lambda: torch.zeros(19))(c),
        ),
        r"master must have as many elements as exp_avg holds \(got 19 vs 20\)",
    ),
    (
        "master_float16",
        lambda c: (
            setattr(c, "params", [p.bfloat16() for p in c.params]),
            _kw(master=lambda: torch.zeros(20, dtype=torch.float16))(c),
        ),
        r"master must be float32 \(got float16\)",
    ),
    (
        "master_aliases_exp_avg",
        lambda c: (
            setattr(c, "params", [p.bfloat16() for p in c.params]),
            _kw(master=lambda: c.exp_avg)(c),
        ),
        r"overlaps .* in memory; every written tensor must own its storage",
    ),
    (
        "stochastic_rounding_float32",
        _kw(stochastic_rounding=True),
        r"stochastic rounding of the parameters \(rounding bit 0\) is for bfloat16 parameters "
        r"without master weights; params are float32",
    ),
    (
        "stochastic_rounding_with_master",
        lambda c: (
            setattr(c, "params", [p.bfloat16() for p in c.params]),
            _kw(master=lambda: torch.zeros(20), stochastic_rounding=True)(c),
        ),
        r"params are bfloat16 with master weights",
    ),
    (
        "lr_tensor_two_elements",
        _kw(lr_tensor=lambda: torch.tensor([1e-3, 1e-3])),
        r"lr_tensor must be a float32 or float64 tensor of one element \(got Float \[2\]\)",
    ),
    (
        "lr_tensor_int",
        _kw(lr_tensor=lambda: torch.tensor(1)),
        r"lr_tensor must be a float32 or float64 tensor of one element \(got Long \[\]\)",
    ),
    (
        "lr_tensor_negative",
        _kw(lr_tensor=lambda: torch.tensor(-1e-3)),
        r"invalid learning rate \(lr_tensor >= 0\): -0\.001",
    ),
    (
        "sparse_grad",
        _set("grads", _replace(1, lambda g: g.to_sparse())),
        r"grads\[1\] is sparse; sparse gradients are not supported",
    ),
    (
        "exp_avg_float64",
        _set("exp_avg", lambda t: t.double()),
        r"exp_avg must be float32 \(got float64\)",
    ),
    (
        "exp_avg_2d",
        _set("exp_avg", lambda t: t.view(4, 5)),
        r"exp_avg must be a contiguous 1-D tensor \(got shape \[4, 5\]\)",
    ),
    (
        "exp_avg_not_contiguous",
        _set("exp_avg", lambda t: torch.randn(40)[::2]),
        r"exp_avg must be a contiguous 1-D tensor",
    ),
    (
        "exp_avg_sq_length",
        _set("exp_avg_sq", lambda t: t[:19]),
        r"exp_avg_sq must have as many elements as exp_avg \(got 19 vs 20\)",
    ),
    (
        "max_exp_avg_sq_length",
        _set("max_exp_avg_sq", lambda t: torch.rand(21)),
        r"max_exp_avg_sq must have as many elements as exp_avg \(got 21 vs 20\)",
    ),
    ("steps_float64", _set("steps", lambda t: t.double()), r"steps must be float32"),
    (
        "slots_shape",
        _set("slots", lambda s: torch.zeros(3, 3, dtype=torch.int64)),
        r"slots must be a contiguous CPU int64 tensor of shape \[3, 2\] or \[3, 4\] "
        r"\(got Long \[3, 3\] on cpu\)",
    ),
    (
        "slot_rows_without_8bit_moments",
        _set("slots", lambda s: torch.cat([s, torch.tensor([[0, 0], [5, 0], [0, 0]])], 1)),
        r"slots\[1\] gives params\[1\] rows of 5 elements; a row length \(column 2 of slots\) "
        r"is for 8-bit moments",
    ),
    (
        "slots_rows",
        _set("slots", lambda s: s[:2]),
        r"slots must be a contiguous CPU int64 tensor of shape \[3, 2\]",
    ),
    (
        "slots_int32",
        _set("slots", lambda s: s.int()),
        r"slots must be a contiguous CPU int64 tensor .*got Int",
    ),
    (
        "slots_not_contiguous",
        _set("slots", lambda s: s.t().contiguous().t()),
        r"slots must be a contiguous CPU int64 tensor",
    ),
    (
        "slot_offset_past_end",
        _set("slots", _slot(2, 0, 15)),
        r"slots\[2\] puts params\[2\] \(6 elements\) at offset 15, outside the state buffers "
        r"of 20 elements",
    ),
    (
        "slot_offset_negative",
        _set("slots", _slot(0, 0, -1)),
        r"slots\[0\] puts params\[0\] \(5 elements\) at offset -1",
    ),
    (
        "slot_step_index_past_end",
        _set("slots", _slot(1, 1, 4)),
        r"slots\[1\] step index 4 is outside steps \(4 counters\)",
    ),
    (
        "slot_step_index_negative",
        _set("slots", _slot(1, 1, -1)),
        r"slots\[1\] step index -1 is outside steps",
    ),
    (
        "overlapping_slices",
        _set("slots", _slot(1, 0, 3)),
        r"two parameters share state elements \(slices at offsets 0 and 3 overlap\); check slots",
    ),
    (
        "shared_step_index",
        _set("slots", _slot(2, 1, 0)),
        r"two parameters share one step counter; check slots",
    ),
    ("params_overlap", _params_overlap, r"params\[1\] overlaps params\[0\] in memory"),
    (
        "param_inside_exp_avg",
        lambda c: setattr(c, "params", [c.exp_avg[15:20], *c.params[1:]]),
        r"(params\[0\] overlaps exp_avg|exp_avg overlaps params\[0\]) in memory",
    ),
    (
        "exp_avg_sq_is_exp_avg",
        lambda c: setattr(c, "exp_avg_sq", c.exp_avg),
        r"exp_avg(_sq)? overlaps exp_avg(_sq)? in memory",
    ),
    (
        "steps_inside_max_exp_avg_sq",
        lambda c: setattr(c, "steps", c.max_exp_avg_sq[16:20]),
        r"(steps overlaps max_exp_avg_sq|max_exp_avg_sq overlaps steps) in memory",
    ),
    (
        "grad_aliases_param",
        lambda c: setattr(c, "grads", [c.params[0], *c.grads[1:]]),
        r"grads\[0\] overlaps params\[0\] in memory; a gradient must not alias what the step "
        r"writes",
    ),
    (
        "grad_inside_exp_avg",
        lambda c: setattr(c, "grads", [c.exp_avg[10:15], *c.grads[1:]]),
        r"grads\[0\] overlaps exp_avg in memory",
    ),
    (
        "found_inf_two_elements",
        _kw(found_inf=lambda: torch.tensor([0.0, 0.0])),
        r"found_inf must be a contiguous tensor of 1 element\(s\) \(got shape \[2\]\)",
    ),
    (
        "found_inf_float64",
        _kw(found_inf=lambda: torch.tensor([0.0], dtype=torch.float64)),
        r"found_inf must be float32 \(got Double\)",
    ),
    (
        "grad_scale_empty",
        _kw(grad_scale=lambda: torch.zeros(0)),
        r"grad_scale must be a contiguous tensor of 1 element\(s\) \(got shape \[0\]\)",
    ),
    (
        "stats_two_elements",
        _kw(stats=lambda: torch.zeros(2)),
        r"stats must be a contiguous tensor of 3 element\(s\)",
    ),
    (
        "clip_coef_int",
        _kw(clip_coef=lambda: torch.ones(1, dtype=torch.int32)),
        r"clip_coef must be float32 \(got Int\)",
    ),
    (  # FP64 is for FP64 parameters
        "clip_coef_double",
        _kw(clip_coef=lambda: torch.ones(1, dtype=torch.float64)),
        r"clip_coef must be float32 \(got Double\)",
    ),
    ("lr_negative", _kw(lr=-1e-3), r"invalid learning rate \(lr >= 0\): -0\.001"),
    ("lr_nan", _kw(lr=math.nan), r"invalid learning rate \(lr >= 0\): nan"),
    ("beta1_one", _kw(beta1=1.0), r"invalid beta1 \(0 <= beta1 < 1\): 1"),
    ("beta2_negative", _kw(beta2=-0.5), r"invalid beta2 \(0 <= beta2 < 1\): -0\.5"),
    ("eps_negative", _kw(eps=-1e-8), r"invalid eps \(eps >= 0\)"),
    ("eps_inf", _kw(eps=math.inf), r"invalid eps \(eps >= 0\): inf"),
    ("weight_decay_negative", _kw(weight_decay=-0.1), r"invalid weight_decay"),
    ("max_grad_norm_negative", _kw(max_grad_norm=-1.0), r"invalid max_grad_norm"),
]


@pytest.mark.parametrize(
    "breaker,message", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_inputs_rejected_and_nothing_changed(breaker, message):
    call = Call()
    breaker(call)
    tensors = call.tensors()
    saved = [t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match=message) as info:
        call.run()
    assert str(info.value).startswith("ruda_torch.adamw_scaled_: "), str(info.value)
    for i, (a, b) in enumerate(zip(saved, tensors, strict=True)):
        assert same_bits(a, b), f"tensor {i} changed although the call was rejected"


@pytest.mark.parametrize(
    "breaker,message", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_check_adamw_scaled_raises_what_adamw_scaled_raises(breaker, message):
    """The validation the optimizer runs before a step's first kernel call (Note [Atomic
    step]): the same error for the same arguments, and nothing written."""
    call = Call()
    breaker(call)
    tensors = call.tensors()
    saved = [t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match=message) as checked:
        call.run(ops.check_adamw_scaled)
    with pytest.raises(RuntimeError) as ran:
        call.run()
    # The same message; the sparse rejection kernel names the operator it guards.
    assert str(checked.value).split(": ", 1)[1] == str(ran.value).split(": ", 1)[1]
    for i, (a, b) in enumerate(zip(saved, tensors, strict=True)):
        assert same_bits(a, b), f"tensor {i} changed although the call was rejected"


def test_meta_lr_tensor_with_cpu_tensors_is_rejected():
    """A stray meta lr_tensor sends the call to the fake kernel, which would do nothing."""
    call = Call()
    call.kwargs["lr_tensor"] = torch.tensor(1e-3, device="meta")
    saved = [t.clone() for t in call.tensors()[:-1]]
    with pytest.raises(RuntimeError, match=r"lr_tensor is a meta tensor; it must be on the CPU"):
        call.run()
    assert all(same_bits(a, b) for a, b in zip(saved, call.tensors()[:-1], strict=True))


def test_check_adamw_scaled_accepts_good_arguments_and_writes_nothing():
    call = Call()
    tensors = call.tensors()
    saved = [t.clone() for t in tensors]
    call.run(ops.check_adamw_scaled)
    for a, b in zip(saved, tensors, strict=True):
        assert same_bits(a, b)
    call.run()
    assert not all(same_bits(a, b) for a, b in zip(saved, tensors, strict=True))


def test_meta_tensor_among_cpu_arguments_is_an_error():
    # docs/design.md section 2: no silent fallback to another backend. One meta tensor among CPU
    # arguments must not send the whole call to the fake (meta) kernel, which does
    # nothing: that would be a step silently not taken.
    call = Call()
    call.kwargs["found_inf"] = torch.zeros(1, device="meta")
    tensors = [t for t in call.tensors() if t.device.type == "cpu"]
    saved = [t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match=r"found_inf.*(cpu|meta)"):
        call.run()
    for a, b in zip(saved, tensors, strict=True):
        assert same_bits(a, b)


def test_valid_call_of_the_bad_inputs_table_runs():
    # The table's base call is valid: every row fails because of its one change.
    call = Call()
    before = call.params[0].clone()
    call.run()
    assert not torch.equal(before, call.params[0])
    assert call.steps.tolist() == [4.0, 6.0, 1.0, 10.0]


# ------------------------------------------------------------------------------ opcheck


def _opcheck_args(amsgrad: bool, grad_dtype: torch.dtype, **control) -> tuple:
    gen = torch.Generator().manual_seed(8)
    params = [torch.randn(5, generator=gen), torch.randn(0), torch.randn(3, 40, generator=gen)]
    grads = [torch.randn(p.shape, generator=gen).to(grad_dtype) for p in params]
    n = 125
    return (
        params,
        grads,
        torch.randn(n, generator=gen),
        torch.rand(n, generator=gen),
        torch.rand(n, generator=gen) if amsgrad else None,
        torch.tensor([0.0, 4.0, 2.0]),
        torch.tensor([[0, 0], [5, 2], [5, 1]]),
        control.get("grad_scale"),
        control.get("found_inf"),
        control.get("stats"),
        control.get("clip_coef"),
        1e-3,
        0.9,
        0.999,
        1e-8,
        1e-2,
        control.get("max_grad_norm", 0.0),
        control.get("maximize", False),
    )


OPCHECK_CASES = [
    ("plain", lambda: _opcheck_args(False, torch.float32)),
    (
        "amsgrad_scaled_found_inf",
        lambda: _opcheck_args(
            True,
            torch.float16,
            grad_scale=torch.tensor([1024.0]),
            found_inf=torch.tensor([0.0]),
            maximize=True,
        ),
    ),
    (
        "stats_clip",
        lambda: _opcheck_args(
            False, torch.bfloat16, stats=torch.tensor([9.0, 1.0, 0.0]), max_grad_norm=1.0
        ),
    ),
    ("clip_coef_skipped", lambda: _opcheck_args(True, torch.float32,
                                                clip_coef=torch.tensor([0.5]),
                                                found_inf=torch.tensor(1.0))),
]  # fmt: skip


@pytest.mark.parametrize(
    "make_args", [c[1] for c in OPCHECK_CASES], ids=[c[0] for c in OPCHECK_CASES]
)
def test_opcheck(make_args):
    torch.library.opcheck(torch.ops.ruda_torch.adamw_scaled_.default, make_args())


# ----------------------------------------------------------------------- functional API


def _functional_inputs(gen, shape, grad_dtype, amsgrad, step=5):
    master = torch.randn(shape, generator=gen)
    grad = (torch.randn(shape, generator=gen) * 64.0).to(grad_dtype)
    state = ruda_torch.AdamWState(
        torch.tensor(float(step)),
        torch.randn(shape, generator=gen) * 0.1,
        torch.rand(shape, generator=gen),
        torch.rand(shape, generator=gen) if amsgrad else None,
    )
    return master, grad, state


def _state_tensors(state: ruda_torch.AdamWState) -> list[torch.Tensor]:
    return [t for t in state.to_parts() if t is not None]


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=DTYPE_IDS)
def test_adamw_step_out_of_place(grad_dtype, amsgrad):
    gen = torch.Generator().manual_seed(seed_of("functional", str(grad_dtype), amsgrad))
    master, grad, state = _functional_inputs(gen, (33, 65), grad_dtype, amsgrad)
    options = ruda_torch.AdamWOptions(lr=1e-2, amsgrad=amsgrad, maximize=amsgrad)
    inputs = [master, grad, *_state_tensors(state)]
    saved = [t.clone() for t in inputs]

    result = ruda_torch.adamw_step(master, grad, state, options, ruda_torch.StepControl(64.0))

    assert result.updated is True
    for a, b in zip(saved, inputs, strict=True):
        assert same_bits(a, b), "adamw_step modified an input"
    outputs = [result.parameters, *_state_tensors(result.state)]
    assert len(outputs) == (5 if amsgrad else 4)
    storages = [t.untyped_storage().data_ptr() for t in inputs]
    out_storages = [t.untyped_storage().data_ptr() for t in outputs]
    assert not set(storages) & set(out_storages), "an output aliases an input"
    assert len(set(out_storages)) == len(out_storages), "outputs share storage"
    new = result.state
    assert result.parameters.shape == master.shape and result.parameters.dtype == torch.float32
    assert new.step.dim() == 0 and new.step.dtype == torch.float32 and new.step.item() == 6.0
    for t in (new.exp_avg, new.exp_avg_sq, new.max_exp_avg_sq):
        assert t is None or (t.shape == master.shape and t.dtype == torch.float32)

    # The same bits as the operator on copies.
    cfg = Config("f", lr=1e-2, amsgrad=amsgrad, maximize=amsgrad, gradient_scale=64.0)
    start = State(
        master.reshape(-1).clone(),
        state.exp_avg.reshape(-1).clone(),
        state.exp_avg_sq.reshape(-1).clone(),
        None if state.max_exp_avg_sq is None else state.max_exp_avg_sq.reshape(-1).clone(),
        5,
    )
    ours = native_step(start, grad.reshape(-1), cfg)
    got = State(
        result.parameters.reshape(-1),
        new.exp_avg.reshape(-1),
        new.exp_avg_sq.reshape(-1),
        None if new.max_exp_avg_sq is None else new.max_exp_avg_sq.reshape(-1),
        6,
    )
    for name in QUANTITIES:
        assert same_bits(got.get(name), ours.get(name)), name
    ref = reference_step(start, grad.reshape(-1), cfg)
    theirs = TorchAdamW(start, cfg)
    theirs.step(torch_input_grad(grad.reshape(-1), 64.0))
    check_against(got, ref, theirs.state(), None, "one_step", "adamw_step")


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_adamw_step_fresh_state(amsgrad):
    gen = torch.Generator().manual_seed(9)
    master = torch.randn(10, generator=gen)
    grad = torch.randn(10, generator=gen).half()
    options = ruda_torch.AdamWOptions(amsgrad=amsgrad)
    result = ruda_torch.adamw_step(master, grad, None, options)
    assert result.updated is True
    assert result.state.step.item() == 1.0
    assert (result.state.max_exp_avg_sq is not None) == amsgrad
    zeros = State(master.clone(), torch.zeros(10), torch.zeros(10),
                  torch.zeros(10) if amsgrad else None, 0)  # fmt: skip
    expected = native_step(zeros, grad, Config("fresh", amsgrad=amsgrad))
    assert same_bits(result.parameters, expected.param)
    # Chaining: the returned state feeds the next step.
    second = ruda_torch.adamw_step(result.parameters, grad, result.state, options)
    assert second.state.step.item() == 2.0
    assert result.state.step.item() == 1.0


@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64])
def test_adamw_step_tensor_lr_gives_the_bits_of_the_float_lr(lr_dtype):
    gen = torch.Generator().manual_seed(12)
    master, grad, state = _functional_inputs(gen, (1025,), torch.float32, amsgrad=False)
    lr = torch.tensor(3e-3, dtype=lr_dtype)
    a = ruda_torch.adamw_step(master, grad, state, ruda_torch.AdamWOptions(lr=lr))
    b = ruda_torch.adamw_step(master, grad, state, ruda_torch.AdamWOptions(lr=float(lr)))
    assert same_bits(a.parameters, b.parameters)
    assert same_bits(a.state.exp_avg, b.state.exp_avg)


def test_adamw_step_non_contiguous_master():
    gen = torch.Generator().manual_seed(10)
    master = torch.randn(13, 9, generator=gen).t()
    grad = torch.randn(13, 9, generator=gen).t()
    assert not master.is_contiguous()
    a = ruda_torch.adamw_step(master, grad, None)
    b = ruda_torch.adamw_step(master.contiguous(), grad.contiguous(), None)
    assert a.parameters.shape == master.shape
    assert torch.equal(a.parameters, b.parameters)
    assert torch.equal(a.state.exp_avg, b.state.exp_avg)


def test_adamw_step_skip_update_bool():
    gen = torch.Generator().manual_seed(11)
    master, grad, state = _functional_inputs(gen, (40,), torch.float32, amsgrad=True)
    options = ruda_torch.AdamWOptions(amsgrad=True)
    result = ruda_torch.adamw_step(
        master, grad, state, options, ruda_torch.StepControl(skip_update=True)
    )
    assert result.updated is False
    assert same_bits(result.parameters, master)
    for a, b in zip(_state_tensors(result.state), _state_tensors(state), strict=True):
        assert same_bits(a, b)
    inputs = {t.untyped_storage().data_ptr() for t in [master, grad, *_state_tensors(state)]}
    for t in [result.parameters, *_state_tensors(result.state)]:
        assert t.untyped_storage().data_ptr() not in inputs, "a skipped step returned an input"


@pytest.mark.parametrize(
    "flag, skips",
    [(1, True), (0, False), (np.True_, True), (np.False_, False), (np.int64(3), True)],
    ids=["int-1", "int-0", "numpy-True", "numpy-False", "numpy-int"],
)
def test_adamw_step_skip_update_by_truth_value(flag, skips):
    """skip_update=1 or numpy.bool_(True) skips, as True does (truth value, not `is True`)."""
    gen = torch.Generator().manual_seed(11)
    master, grad, state = _functional_inputs(gen, (40,), torch.float32, amsgrad=False)
    result = ruda_torch.adamw_step(
        master, grad, state, None, ruda_torch.StepControl(skip_update=flag)
    )
    assert result.updated is (not skips)
    assert same_bits(result.parameters, master) == skips


@pytest.mark.parametrize("flag", [1.0, "yes", None], ids=["float", "str", "None"])
def test_step_control_rejects_other_skip_flags(flag):
    with pytest.raises(TypeError, match="skip_update must be a bool, an int or a one-element"):
        ruda_torch.StepControl(skip_update=flag)


@pytest.mark.parametrize("scale", [0.0, -2.0, math.inf, math.nan], ids=str)
def test_adamw_step_unusable_tensor_scale_skips(scale):
    """A float scale of 0 is rejected on the host; a tensor one can only be seen on the
    device, where it skips the step instead of writing NaN (decide_step)."""
    gen = torch.Generator().manual_seed(14)
    master, grad, state = _functional_inputs(gen, (97,), torch.float32, amsgrad=True)
    control = ruda_torch.StepControl(gradient_scale=torch.tensor(scale))
    result = ruda_torch.adamw_step(
        master, grad, state, ruda_torch.AdamWOptions(amsgrad=True), control
    )
    assert isinstance(result.updated, torch.Tensor) and not bool(result.updated)
    assert same_bits(result.parameters, master)
    for a, b in zip(_state_tensors(result.state), _state_tensors(state), strict=True):
        assert same_bits(a, b)
    with pytest.raises(ValueError, match="gradient_scale must be positive"):
        ruda_torch.adamw_step(master, grad, state, None, ruda_torch.StepControl(gradient_scale=0.0))


@pytest.mark.parametrize(
    "skip_value,shape", [(0.0, ()), (0.0, (1,)), (1.0, ()), (1.0, (1,)), (2.0, (1,))]
)
def test_adamw_step_skip_update_tensor(skip_value, shape):
    gen = torch.Generator().manual_seed(12)
    master, grad, state = _functional_inputs(gen, (40,), torch.bfloat16, amsgrad=False)
    skip = torch.full(shape, skip_value)
    result = ruda_torch.adamw_step(
        master, grad, state, None, ruda_torch.StepControl(skip_update=skip)
    )
    assert isinstance(result.updated, torch.Tensor)
    assert result.updated.dtype == torch.bool and result.updated.dim() == 0
    assert bool(result.updated) == (skip_value == 0.0)
    plain = ruda_torch.adamw_step(master, grad, state)
    expected = plain if skip_value == 0.0 else None
    if expected is None:
        assert same_bits(result.parameters, master)
        assert result.state.step.item() == state.step.item()
    else:
        assert same_bits(result.parameters, expected.parameters)
        assert result.state.step.item() == state.step.item() + 1


def test_adamw_step_gradient_scale_tensor_equals_float():
    gen = torch.Generator().manual_seed(13)
    master, grad, state = _functional_inputs(gen, (100,), torch.float16, amsgrad=False)
    a = ruda_torch.adamw_step(master, grad, state, None, ruda_torch.StepControl(3.0))
    b = ruda_torch.adamw_step(master, grad, state, None, ruda_torch.StepControl(torch.tensor(3.0)))
    assert same_bits(a.parameters, b.parameters)
    assert same_bits(a.state.exp_avg_sq, b.state.exp_avg_sq)


def test_adamw_state_parts_round_trip():
    gen = torch.Generator().manual_seed(14)
    _, _, state = _functional_inputs(gen, (4, 3), torch.float32, amsgrad=True)
    parts = state.to_parts()
    assert len(parts) == 4
    again = ruda_torch.AdamWState.from_parts(*parts)
    for a, b in zip(again.to_parts(), parts, strict=True):
        assert same_bits(a, b)
    from_int = ruda_torch.AdamWState.from_parts(7, state.exp_avg, state.exp_avg_sq)
    assert same_bits(from_int.step, torch.tensor(7.0))
    assert from_int.max_exp_avg_sq is None
    from_1d = ruda_torch.AdamWState.from_parts(torch.tensor([2.0]), *parts[1:])
    assert from_1d.step.shape == () and from_1d.step.item() == 2.0


FROM_PARTS_ERRORS = [
    ("negative_step", lambda s: (-1, s.exp_avg, s.exp_avg_sq), r"non-negative integer"),
    ("bool_step", lambda s: (True, s.exp_avg, s.exp_avg_sq), r"must be a number"),
    ("float_step", lambda s: (1.5, s.exp_avg, s.exp_avg_sq), r"non-negative integer"),
    ("step_two_values", lambda s: (torch.zeros(2), s.exp_avg, s.exp_avg_sq), r"one value"),
    ("nan_step", lambda s: (torch.tensor(math.nan), s.exp_avg, s.exp_avg_sq), r"non-negative"),
    ("inf_step", lambda s: (math.inf, s.exp_avg, s.exp_avg_sq), r"non-negative integer"),
    ("negative_tensor_step", lambda s: (torch.tensor(-2.0), s.exp_avg, s.exp_avg_sq), r"integer"),
    ("none_step", lambda s: (None, s.exp_avg, s.exp_avg_sq), r"must be a number"),
    ("str_step", lambda s: ("3", s.exp_avg, s.exp_avg_sq), r"must be a number"),
    ("meta_step", lambda s: (torch.tensor(3.0, device="meta"), s.exp_avg, s.exp_avg_sq), r"meta"),
    (
        "exp_avg_sq_shape",
        lambda s: (s.step, s.exp_avg, s.exp_avg_sq.reshape(-1)),
        r"exp_avg_sq must match exp_avg's shape",
    ),
    (
        "max_exp_avg_sq_shape",
        lambda s: (s.step, s.exp_avg, s.exp_avg_sq, torch.zeros(5)),
        r"max_exp_avg_sq must match exp_avg's shape",
    ),
]


@pytest.mark.parametrize(
    "make,message", [c[1:] for c in FROM_PARTS_ERRORS], ids=[c[0] for c in FROM_PARTS_ERRORS]
)
def test_adamw_state_from_parts_rejects(make, message):
    _, _, state = _functional_inputs(torch.Generator().manual_seed(15), (4, 3), torch.float32, True)
    with pytest.raises(ValueError, match=message):
        ruda_torch.AdamWState.from_parts(*make(state))


@dataclass
class FunctionalCall:
    master: torch.Tensor
    gradient: torch.Tensor
    state: ruda_torch.AdamWState | None
    options: ruda_torch.AdamWOptions
    control: ruda_torch.StepControl

    def tensors(self) -> list[torch.Tensor]:
        out = [self.master, self.gradient]
        if self.state is not None:
            out += _state_tensors(self.state)
        for v in (self.control.gradient_scale, self.control.skip_update):
            if isinstance(v, torch.Tensor):
                out.append(v)
        return out


def _functional_call() -> FunctionalCall:
    master, grad, state = _functional_inputs(
        torch.Generator().manual_seed(16), (6, 5), torch.float16, True
    )
    return FunctionalCall(
        master, grad, state, ruda_torch.AdamWOptions(amsgrad=True), ruda_torch.StepControl()
    )


def _state_field(**changes):
    def apply(c: FunctionalCall):
        c.state = replace(c.state, **{k: v(c.state) for k, v in changes.items()})

    return apply


FUNCTIONAL_ERRORS = [
    # (id, break the call, expected message); all raise ValueError
    (
        "gradient_shape",
        lambda c: setattr(c, "gradient", c.gradient.reshape(5, 6)),
        r"gradient must match master \(shape \(6, 5\) on cpu\), got \(5, 6\) on cpu",
    ),
    (
        "gradient_float64",
        lambda c: setattr(c, "gradient", c.gradient.double()),
        r"gradient must be a float32, float16 or bfloat16 tensor, got torch.float64",
    ),
    (
        "gradient_int",
        lambda c: setattr(c, "gradient", torch.ones(6, 5, dtype=torch.int32)),
        r"gradient must be a float32, float16 or bfloat16 tensor",
    ),
    (
        "gradient_sparse",
        lambda c: setattr(c, "gradient", c.gradient.float().to_sparse()),
        r"gradient must be dense; sparse gradients are not supported",
    ),
    (
        "master_float64",
        lambda c: setattr(c, "master", c.master.double()),
        r"master must be a float32 tensor, got torch.float64",
    ),
    (
        "master_bfloat16",
        lambda c: setattr(c, "master", c.master.bfloat16()),
        r"master must be a float32 tensor",
    ),
    (
        "amsgrad_without_max_exp_avg_sq",
        _state_field(max_exp_avg_sq=lambda s: None),
        r"options.amsgrad is set but state.max_exp_avg_sq is None",
    ),
    (
        "exp_avg_shape",
        _state_field(exp_avg=lambda s: s.exp_avg.reshape(-1)),
        r"state.exp_avg must be float32 with master's shape \(6, 5\)",
    ),
    (
        "exp_avg_sq_float16",
        _state_field(exp_avg_sq=lambda s: s.exp_avg_sq.half()),
        r"state.exp_avg_sq must be float32",
    ),
    (
        "step_two_values",
        _state_field(step=lambda s: torch.zeros(2)),
        r"state.step must be one value on cpu",
    ),
    (
        "gradient_scale_zero",
        lambda c: setattr(c, "control", ruda_torch.StepControl(gradient_scale=0.0)),
        r"StepControl.gradient_scale must be positive, got 0.0",
    ),
    (
        "gradient_scale_negative",
        lambda c: setattr(c, "control", ruda_torch.StepControl(gradient_scale=-2.0)),
        r"StepControl.gradient_scale must be positive",
    ),
    (
        "gradient_scale_inf",
        lambda c: setattr(c, "control", ruda_torch.StepControl(gradient_scale=math.inf)),
        r"StepControl.gradient_scale must be positive, got inf",
    ),
    (
        "gradient_scale_nan",
        lambda c: setattr(c, "control", ruda_torch.StepControl(gradient_scale=math.nan)),
        r"StepControl.gradient_scale must be positive, got nan",
    ),
    (
        "gradient_scale_tensor_two_values",
        lambda c: setattr(c, "control", ruda_torch.StepControl(torch.tensor([1.0, 2.0]))),
        r"StepControl.gradient_scale must hold one value, got shape \(2,\)",
    ),
    (
        "skip_update_tensor_two_values",
        lambda c: setattr(c, "control", ruda_torch.StepControl(skip_update=torch.zeros(2))),
        r"StepControl.skip_update must hold one value, got shape \(2,\)",
    ),
]


@pytest.mark.parametrize(
    "breaker,message", [c[1:] for c in FUNCTIONAL_ERRORS], ids=[c[0] for c in FUNCTIONAL_ERRORS]
)
def test_adamw_step_validation_leaves_inputs_unchanged(breaker, message):
    call = _functional_call()
    breaker(call)
    tensors = call.tensors()
    saved = [t.clone() for t in tensors]
    with pytest.raises(ValueError, match=message):
        ruda_torch.adamw_step(call.master, call.gradient, call.state, call.options, call.control)
    for a, b in zip(saved, tensors, strict=True):
        assert same_bits(a, b)


OPTIONS_ERRORS = [
    (dict(lr=-1.0), r"Invalid learning rate: -1.0"),
    (dict(lr=math.inf), r"Invalid learning rate: inf"),
    (dict(lr=torch.tensor([1e-3, 1e-3])), r"Tensor lr must be 1-element"),
    (dict(lr=torch.tensor(-1e-3)), r"Invalid learning rate"),
    (dict(lr=torch.tensor(1)), r"Tensor lr must be float32 or float64, got torch.int64"),
    (dict(eps=-1e-8), r"Invalid epsilon value: -1e-08"),
    (dict(betas=(1.0, 0.999)), r"Invalid beta parameter at index 0: 1.0"),
    (dict(betas=(0.9, -0.1)), r"Invalid beta parameter at index 1: -0.1"),
    (dict(betas=(0.9,)), r"betas must be a pair of floats"),
    (dict(weight_decay=-1e-4), r"Invalid weight_decay value: -0.0001"),
]


@pytest.mark.parametrize("kwargs,message", OPTIONS_ERRORS, ids=[str(k) for k, _ in OPTIONS_ERRORS])
def test_adamw_options_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ruda_torch.AdamWOptions(**kwargs)


def test_adamw_options_defaults_are_ruda_torchs():
    o = ruda_torch.AdamWOptions()
    assert (o.lr, o.betas, o.eps, o.weight_decay, o.amsgrad, o.maximize) == (
        1e-3,
        (0.9, 0.999),
        1e-5,
        1e-4,
        False,
        False,
    )


# ---------------------------------------------------------------- compiled backends


def test_compiled_backends_include_cpu():
    backends = ruda_torch.compiled_backends()
    assert isinstance(backends, tuple)
    assert "cpu" in backends
    assert set(backends) <= {"cpu", "cuda"}


def test_check_device_names_the_compiled_backends():
    from ruda_torch import _build

    assert _build.check_device(torch.device("cpu"), "x") is None
    listed = ", ".join(ruda_torch.compiled_backends())
    with pytest.raises(
        RuntimeError, match=rf"x got tensors on meta.*\(compiled backends: {listed}\)"
    ):
        _build.check_device(torch.device("meta"), "x")


def test_adamw_step_on_a_device_without_kernels():
    master = torch.empty(4, device="meta")
    with pytest.raises(RuntimeError, match=r"ruda_torch.adamw_step got tensors on meta"):
        ruda_torch.adamw_step(master, torch.empty(4, device="meta"), None)


# --------------------------------------------------------------------------- NaN bits

_NAN_PATTERNS = [0x7FC00001, 0xFFC00000, 0x7FA00000, 0xFFFFFFFF]  # payloads, sign, signaling


def _nan(bits: int) -> float:
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


@pytest.mark.parametrize("numel", [97, 1025], ids=["97", "1025"])
def test_every_nan_the_update_writes_is_canonical(numel):
    """Note [Canonical NaN]: NaN gradients (with payloads, either sign, signaling), an
    inf that makes 0 * inf, and a NaN already in the AMSGrad maximum: every NaN written
    to parameters and moments has CUDA's bits 0x7FFFFFFF, in the vector loop and in the
    leftover elements, so the CPU and CUDA kernels agree bit for bit here too."""
    gen = torch.Generator().manual_seed(numel)
    p = torch.randn(numel, generator=gen)
    g = torch.randn(numel, generator=gen)
    m, v, vm = torch.zeros(numel + 15), torch.zeros(numel + 15), torch.zeros(numel + 15)
    positions = [0, 9, numel - 1, numel - 3]  # vector lanes and the leftover loop
    for k, bits in zip(positions, _NAN_PATTERNS, strict=True):
        g[k] = _nan(bits)
    g[5] = math.inf  # m finite * 0.9 + inf: inf; v: inf; p: inf / inf = NaN
    vm[12] = _nan(0x7FC0BEEF)
    steps = torch.zeros(1)
    ops.adamw_scaled_(
        [p], [g], m, v, vm, steps, torch.tensor([[0, 0]]),
        lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
    )  # fmt: skip
    seen = 0
    for name, t in (("param", p), ("exp_avg", m), ("exp_avg_sq", v), ("max_exp_avg_sq", vm)):
        bits = t.view(torch.int32)
        nan = torch.isnan(t)
        seen += int(nan.sum())
        assert (bits[nan] == 0x7FFFFFFF).all(), f"{name}: {bits[nan].tolist()}"
    assert seen >= 4 * len(positions)
