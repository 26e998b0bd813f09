"""The CUDA kernels of the native operators against the CPU ones, bit for bit.

Note [One math, two backends] (csrc/adamw_math.h) and Note [Canonical reduction order]
(csrc/grad_stats.h) promise that the CPU and CUDA kernels give the same bits for the
same inputs; the CPU kernels are checked against the FP64 reference, torch.optim.AdamW
and a NumPy emulation in tests/test_ops.py and tests/test_stats.py, so parity here
carries those checks over to the GPU. Also: no host synchronization in a full fused
optimizer step, a tensor of more than 2**31 elements, and device errors.

Every test needs a CUDA device (marked `gpu`, skipped without one). A GPU without the
CUDA kernels built fails them: nothing falls back to the CPU silently.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_ops import (
    CONFIGS,
    DTYPE_IDS,
    GRAD_DTYPES,
    QUANTITIES,
    Bucket,
    Config,
    State,
    make_bucket,
    native_step,
    odd_view,
    random_state,
    same_bits,
    seed_of,
    stored_grad,
)
from test_stats import random_grad, run_analyze, run_merge

import ruda_torch
from ruda_torch import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
SIZES = [0, 1, 7, 97, 1025, 4097, 65537]
N_STEPS = 3


def to_device(state: State, device) -> State:
    def move(t):
        return None if t is None else t.to(device)

    return State(*(move(state.get(q)) for q in QUANTITIES), state.step)


def assert_states_bitwise(cpu: State, cuda: State, what: str) -> None:
    for name in QUANTITIES:
        a, b = cpu.get(name), cuda.get(name)
        assert same_bits(a, None if b is None else b.cpu()), f"{what}: {name} differs"
    assert cpu.step == cuda.step, f"{what}: step"


def bucket_to(bucket: Bucket, device) -> Bucket:
    def move(t):
        return None if t is None else t.to(device)

    return Bucket(
        [p.to(device) for p in bucket.params],
        list(bucket.offsets),
        list(bucket.step_ids),
        bucket.exp_avg.to(device),
        bucket.exp_avg_sq.to(device),
        move(bucket.max_exp_avg_sq),
        bucket.steps.to(device),
    )


# ------------------------------------------------------------------ adamw_scaled_ parity


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.id for c in CONFIGS])
def test_adamw_cuda_matches_cpu_bitwise(cfg, numel, grad_dtype):
    gen = torch.Generator().manual_seed(seed_of("gpu", cfg.id, numel, str(grad_dtype)))
    on_cpu = random_state(gen, numel, cfg)
    on_cuda = to_device(on_cpu, CUDA)
    for k in range(N_STEPS):
        grad = stored_grad(gen, numel, grad_dtype, cfg.gradient_scale)
        grad_cuda = grad.to(CUDA)
        saved = grad_cuda.clone()
        on_cpu = native_step(on_cpu, grad, cfg)
        on_cuda = native_step(on_cuda, grad_cuda, cfg)
        assert same_bits(grad_cuda, saved), "the CUDA kernel wrote the gradient"
        assert_states_bitwise(on_cpu, on_cuda, f"step {k + 1}")


@pytest.mark.parametrize("layout", ["aligned", "gapped"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_adamw_cuda_bucket_matches_cpu_bitwise(amsgrad, grad_dtype, layout):
    """A bucket laid out as the optimizer lays it out (slices on 64-byte boundaries: the
    kernel's 16-byte vector path) and one with 3-element gaps (unaligned slices: the
    scalar path)."""
    cfg = Config("gpu_bucket", lr=1e-2, weight_decay=0.05, amsgrad=amsgrad, maximize=amsgrad)
    gen = torch.Generator().manual_seed(seed_of("gpu_bucket", amsgrad, str(grad_dtype), layout))
    shapes = [(7, 13), (0,), (1,), (4096 * 3 + 5,), (65537,), (4095,), (33,)]
    cpu = make_bucket(gen, shapes, amsgrad, align=16 if layout == "aligned" else None)
    if layout == "aligned":
        assert all(off % 16 == 0 for off in cpu.offsets)
    cuda = bucket_to(cpu, CUDA)
    active = [0, 1, 3, 4, 6]
    grads = [stored_grad(gen, cpu.params[i].numel(), grad_dtype, 3.0) for i in active]
    grads = [g.view(cpu.params[i].shape) for g, i in zip(grads, active, strict=True)]
    for bucket, device in ((cpu, "cpu"), (cuda, CUDA)):
        for _ in range(N_STEPS):
            ops.adamw_scaled_(
                [bucket.params[i] for i in active],
                [g.to(device) for g in grads],
                bucket.exp_avg,
                bucket.exp_avg_sq,
                bucket.max_exp_avg_sq,
                bucket.steps,
                bucket.slots(active),
                grad_scale=torch.tensor([3.0], device=device),
                found_inf=torch.zeros((), device=device),
                **cfg.op_kwargs(),
            )
    for i, (a, b) in enumerate(zip(cpu.written(), cuda.written(), strict=True)):
        assert same_bits(a, b.cpu()), f"written tensor {i} differs between CPU and CUDA"


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("numel", [97, 65537])
def test_adamw_cuda_unaligned_views(numel, grad_dtype):
    cfg = Config("gpu_unaligned", amsgrad=True, gradient_scale=3.0)
    gen = torch.Generator().manual_seed(seed_of("gpu_unaligned", numel, str(grad_dtype)))
    start = random_state(gen, numel, cfg)
    grads = [stored_grad(gen, numel, grad_dtype, 3.0) for _ in range(N_STEPS)]
    on_cpu = start
    for g in grads:
        on_cpu = native_step(on_cpu, g, cfg)
    views = [
        odd_view(start.get(q).to(CUDA), off)[0]
        for q, off in zip(QUANTITIES, (1, 3, 1, 2), strict=True)
    ]
    steps, _ = odd_view(torch.tensor([float(start.step)], device=CUDA), 1)
    for g in grads:
        g_view, _ = odd_view(g.to(CUDA), 1)
        ops.adamw_scaled_(
            [views[0]],
            [g_view],
            views[1],
            views[2],
            views[3],
            steps,
            torch.zeros(1, 2, dtype=torch.int64),
            grad_scale=torch.tensor([3.0], device=CUDA),
            **cfg.op_kwargs(),
        )
    assert_states_bitwise(on_cpu, State(*views, int(steps.item())), "unaligned")


SKIP_CLIP_CASES = [
    # (id, control on the device, skipped?)
    ("found_inf_0d", lambda d: dict(found_inf=torch.tensor(2.0, device=d)), True),
    ("found_inf_1d", lambda d: dict(found_inf=torch.tensor([1.0], device=d)), True),
    ("found_inf_zero", lambda d: dict(found_inf=torch.tensor([0.0], device=d)), False),
    ("stats_nonfinite", lambda d: dict(stats=torch.tensor([4.0, 1.0, 1.0], device=d)), True),
    (
        "stats_clip",
        lambda d: dict(stats=torch.tensor([16.0, 1.0, 0.0], device=d), max_grad_norm=1.0),
        False,
    ),
    ("clip_coef", lambda d: dict(clip_coef=torch.tensor([0.3], device=d)), False),
]


@pytest.mark.parametrize(
    "control,skipped", [c[1:] for c in SKIP_CLIP_CASES], ids=[c[0] for c in SKIP_CLIP_CASES]
)
def test_adamw_cuda_skip_and_clip_match_cpu(control, skipped):
    cfg = Config("gpu_control", amsgrad=True, maximize=True, gradient_scale=512.0)
    gen = torch.Generator().manual_seed(seed_of("gpu_control", skipped))
    start = random_state(gen, 1025, cfg)
    grad = stored_grad(gen, 1025, torch.float16, 512.0)
    on_cpu = native_step(start, grad, cfg, **control("cpu"))
    on_cuda = native_step(to_device(start, CUDA), grad.to(CUDA), cfg, **control(CUDA))
    assert_states_bitwise(on_cpu, on_cuda, "control")
    if skipped:
        assert_states_bitwise(start, on_cuda, "skipped step")


DEVICE_ERRORS = [
    # (id, break the CUDA call, expected message)
    (
        "slots_on_cuda",
        lambda a: a.update(slots=a["slots"].to(CUDA)),
        r"slots must be a contiguous CPU int64 tensor of shape \[2, 2\] .* on cuda:0\)",
    ),
    (
        "grad_on_cpu",
        lambda a: a.update(grads=[a["grads"][0], a["grads"][1].cpu()]),
        r"grads\[1\] must be on cuda:0 like the first tensor \(got cpu\)",
    ),
    (
        "param_on_cpu",
        lambda a: a.update(params=[a["params"][0], a["params"][1].cpu()]),
        r"params\[1\] must be on cuda:0 like the first tensor \(got cpu\)",
    ),
    (
        "exp_avg_on_cpu",
        lambda a: a.update(exp_avg=a["exp_avg"].cpu()),
        r"exp_avg must be on cuda:0 like the first tensor \(got cpu\)",
    ),
    (
        "found_inf_on_cpu",
        lambda a: a.update(found_inf=torch.zeros(1)),
        r"found_inf must be on cuda:0 like the first tensor \(got cpu\)",
    ),
    (
        "grad_scale_on_cpu",
        lambda a: a.update(grad_scale=torch.ones(1)),
        r"grad_scale must be on cuda:0",
    ),
]


@pytest.mark.parametrize(
    "breaker,message", [c[1:] for c in DEVICE_ERRORS], ids=[c[0] for c in DEVICE_ERRORS]
)
def test_adamw_cuda_device_errors_change_nothing(breaker, message):
    args = dict(
        params=[torch.randn(5, device=CUDA), torch.randn(7, device=CUDA)],
        grads=[torch.randn(5, device=CUDA), torch.randn(7, device=CUDA)],
        exp_avg=torch.randn(12, device=CUDA),
        exp_avg_sq=torch.rand(12, device=CUDA),
        max_exp_avg_sq=None,
        steps=torch.tensor([1.0, 2.0], device=CUDA),
        slots=torch.tensor([[0, 0], [5, 1]]),
        grad_scale=torch.ones(1, device=CUDA),
        found_inf=torch.zeros(1, device=CUDA),
    )
    breaker(args)
    tensors = [*args["params"], *args["grads"], args["exp_avg"], args["exp_avg_sq"], args["steps"]]
    saved = [t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match=message):
        ops.adamw_scaled_(
            args["params"],
            args["grads"],
            args["exp_avg"],
            args["exp_avg_sq"],
            args["max_exp_avg_sq"],
            args["steps"],
            args["slots"],
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            grad_scale=args["grad_scale"],
            found_inf=args["found_inf"],
        )
    torch.cuda.synchronize()
    for a, b in zip(saved, tensors, strict=True):
        assert same_bits(a, b)


# ------------------------------------------------------------- no host synchronization


def test_fused_hierarchical_step_does_not_sync():
    gen = torch.Generator().manual_seed(31)
    shapes = [(256, 128), (128,), (4097,), (3, 5, 7), (0,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(CUDA)) for s in shapes]
    opt = ruda_torch.AdamW(
        params, lr=1e-3, fused_step=True, hierarchical_stats=True, max_grad_norm=1.0
    )

    def set_grads():
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 1024.0).to(CUDA)
        # What torch.amp.GradScaler sets before calling step() on an optimizer with
        # _step_supports_amp_scaling: the (1,)-shaped scale and found_inf on the device.
        opt.grad_scale = torch.full((1,), 1024.0, device=CUDA)
        opt.found_inf = torch.zeros(1, device=CUDA)

    set_grads()
    opt.step()  # the first step builds the buckets and the state
    torch.cuda.synchronize()
    before = [p.detach().clone() for p in params]
    set_grads()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
        report = opt.last_report  # reading the attribute itself must not sync either
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert report is not None
    assert not bool(report.skipped)
    assert float(report.clip_coef) <= 1.0
    assert math.isfinite(float(report.grad_norm))
    changed = [not torch.equal(a, p.detach()) for a, p in zip(before, params, strict=True)]
    assert all(changed[:4]), "a parameter with a gradient was not updated"


# --------------------------------------------------------------- more than 2**31 elements

HUGE = 2**31 + 4097


def _require_gpu_memory(needed: int) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < needed:
        pytest.skip(f"needs {needed / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} free")


def test_adamw_and_stats_beyond_int32_indexing():
    _require_gpu_memory(HUGE * (4 + 2 + 4 + 4) + 2**30)  # param, BF16 grad, moments, slack
    gen = torch.Generator(device=CUDA).manual_seed(0)
    param = torch.empty(HUGE, device=CUDA).uniform_(-1.0, 1.0, generator=gen)
    grad = torch.empty(HUGE, device=CUDA, dtype=torch.bfloat16).normal_(0.0, 4.0, generator=gen)
    exp_avg = torch.empty(HUGE, device=CUDA).normal_(0.0, 0.01, generator=gen)
    exp_avg_sq = torch.empty(HUGE, device=CUDA).uniform_(0.0, 1e-4, generator=gen)
    steps = torch.tensor([4.0], device=CUDA)
    positions = [0, 1, 4095, 4096, 2**31 - 1, 2**31, 2**31 + 1, 2**31 + 4096, HUGE - 2, HUGE - 1]
    positions += torch.randint(0, HUGE, (22,), generator=torch.Generator().manual_seed(1)).tolist()
    idx = torch.tensor(sorted({i for i in positions if i < HUGE}), device=CUDA)
    samples = [t[idx].cpu() for t in (param, grad, exp_avg, exp_avg_sq)]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

    ops.adamw_scaled_(
        [param],
        [grad],
        exp_avg,
        exp_avg_sq,
        None,
        steps,
        torch.zeros(1, 2, dtype=torch.int64),
        grad_scale=torch.tensor([3.0], device=CUDA),
        **hyper,
    )
    # The same elements through the CPU kernel (its leftover loop: the same math).
    p, g, m, v = (t.clone() for t in samples)
    cpu_steps = torch.tensor([4.0])
    ops.adamw_scaled_(
        [p], [g], m, v, None, cpu_steps, torch.zeros(1, 2, dtype=torch.int64),
        grad_scale=torch.tensor([3.0]), **hyper,
    )  # fmt: skip
    assert steps.item() == 5.0
    for name, got, expected in (
        ("param", param[idx].cpu(), p),
        ("exp_avg", exp_avg[idx].cpu(), m),
        ("exp_avg_sq", exp_avg_sq[idx].cpu(), v),
    ):
        assert same_bits(got, expected), f"{name} at {idx.tolist()}"
    del param, exp_avg, exp_avg_sq

    # Statistics rows of the same gradient: the rows around 2**31 against the CPU kernel.
    rows = torch.empty(ops.stats_rows_for(HUGE), 3, device=CUDA)
    ops.analyze_gradient([grad], rows, torch.tensor([3.0], device=CUDA))
    last_row = rows.shape[0] - 1
    for r in sorted({min(r, last_row) for r in (0, (2**31 - 1) // 4096, 2**31 // 4096, last_row)}):
        chunk = grad[r * 4096 : (r + 1) * 4096].cpu()
        expected = torch.empty(1, 3)
        ops.analyze_gradient([chunk], expected, torch.tensor([3.0]))
        assert same_bits(rows[r].cpu(), expected[0]), f"statistics row {r}"
    del grad, rows
    torch.cuda.empty_cache()


# ------------------------------------------------------------------- statistics parity

STATS_SIZES = [0, 1, 255, 4095, 4096, 4097, 3 * 4096 + 100, 1_000_003]


@pytest.mark.parametrize(
    "grad_scale", [None, 1024.0, 3.0, 2.0**-49], ids=["unscaled", "1024", "3", "2^-49"]
)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=DTYPE_IDS)
def test_analyze_gradient_cuda_matches_cpu_bitwise(dtype, grad_scale):
    gen = torch.Generator().manual_seed(seed_of("gpu_stats", str(dtype), grad_scale))
    grads = [random_grad(gen, n, dtype, grad_scale or 1.0) for n in STATS_SIZES]
    grads[2][7] = float("nan")
    grads[5][4096] = float("-inf")  # in a full row: the CPU's finite form must give way
    # A finite element whose unscaled square overflows FP32 (2e19^2 > 3.4e38), stored
    # times the scale; FP16 cannot store one unless the scale is tiny (60000 / 2^-49).
    scale = grad_scale or 1.0
    big = 2.0e19 * scale if dtype != torch.float16 else 60000.0
    grads[6][5] = big
    overflows = (float(grads[6][5]) / scale) ** 2 > 3.4028234663852886e38
    assert overflows or (dtype == torch.float16 and scale >= 1.0)
    cpu_rows = run_analyze(grads, grad_scale)
    if overflows:  # the row holding it: its sum is inf, nothing counted as non-finite
        row = sum(ops.stats_rows_for(n) for n in STATS_SIZES[:6])
        assert math.isinf(cpu_rows[row, 0].item()) and cpu_rows[row, 2].item() == 0
    cuda_grads = [g.to(CUDA) for g in grads]
    cuda_rows = run_analyze(cuda_grads, grad_scale)
    assert same_bits(cpu_rows, cuda_rows.cpu())
    for a, b in zip(grads, cuda_grads, strict=True):
        assert same_bits(a, b.cpu()), "analyze_gradient wrote a gradient"
    # The whole report through the plan.
    plan = ruda_torch.StatsPlan(cpu_rows.shape[0])
    reports = []
    for rows in (cpu_rows, cuda_rows):
        out = torch.empty(3, device=rows.device)
        plan.reduce(rows, torch.empty(max(plan.scratch_elements, 1), device=rows.device), out)
        reports.append(out.cpu())
    assert same_bits(reports[0], reports[1])


@pytest.mark.parametrize("n_rows", [1, 255, 1024, 1025, 3000, 1024 * 1024 + 1])
def test_merge_gradient_stats_cuda_matches_cpu_bitwise(n_rows):
    gen = torch.Generator().manual_seed(n_rows)
    rows = torch.rand(n_rows, 3, generator=gen)
    rows[:, 0] *= torch.pow(10.0, torch.empty(n_rows).uniform_(-6, 3, generator=gen))
    rows[:, 2] = torch.randint(0, 3, (n_rows,), generator=gen).float()
    assert same_bits(run_merge(rows), run_merge(rows.to(CUDA)).cpu())


@pytest.mark.parametrize("n_reports", [0, 1, 5, 64])
def test_merge_gradient_stats_chunks_cuda_matches_cpu_bitwise(n_reports):
    gen = torch.Generator().manual_seed(200 + n_reports)
    reports = torch.rand(n_reports, 3, generator=gen) * 1e3
    out_cpu = torch.empty(3)
    out_cuda = torch.empty(3, device=CUDA)
    ops.merge_gradient_stats_chunks(reports, out_cpu)
    ops.merge_gradient_stats_chunks(reports.to(CUDA), out_cuda)
    assert same_bits(out_cpu, out_cuda.cpu())


def test_cuda_is_a_compiled_backend():
    # A GPU is present: the CUDA kernels must have been built (no silent CPU fallback).
    assert "cuda" in ruda_torch.compiled_backends()


# ------------------------------------------------------------------ mixed CPU/CUDA buckets


@pytest.mark.parametrize(
    "inject", [None, "cuda", "cpu"], ids=["finite", "inf-on-cuda", "inf-on-cpu"]
)
def test_cpu_and_cuda_buckets_share_one_decision(inject):
    """One optimizer with a CUDA group and a CPU group (partial offload): the CPU bucket
    reads the report and GradScaler's found_inf, made on CUDA, only after they have
    arrived (ruda_torch._stats.to_device). A non-finite gradient on either device skips
    both buckets, and every step equals the all-CPU run bit for bit (max_grad_norm is
    far above the norm, so the clip coefficient is exactly 1 whatever order the two
    devices' reports are folded in)."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(97,), (33, 5), (1025,)]
    base = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]

    def run(devices):
        params = [torch.nn.Parameter(b.clone().to(d)) for b, d in zip(base, devices, strict=True)]
        groups = [{"params": [p]} for p in params]
        opt = ruda_torch.AdamW(
            groups, lr=1e-2, fused_step=True, hierarchical_stats=True, max_grad_norm=1e6
        )
        for step in range(3):
            for p, g in zip(params, grads, strict=True):
                p.grad = (g * (step + 1)).to(p.device)
            if inject is not None and step == 1:
                target = next(p for p in params if p.device.type == inject)
                target.grad.view(-1)[0] = math.inf
            opt.step()
        return [p.detach().cpu() for p in params], opt

    mixed, opt = run([CUDA, "cpu", CUDA])
    reference, _ = run(["cpu", "cpu", "cpu"])
    for a, b in zip(mixed, reference, strict=True):
        assert same_bits(a, b), "a mixed CPU/CUDA step differs from the all-CPU one"
    expected_steps = 2.0 if inject is not None else 3.0
    for group in opt.param_groups:
        assert opt.state[group["params"][0]]["step"].item() == expected_steps


def test_bucket_state_offsets_and_merges_beyond_int32():
    """A bucket whose second tensor's state slice starts past 2**31 elements (64-bit
    state_offset in the table and the kernels), and the statistics of the whole bucket
    through the merge kernel at that size (over 2**19 rows, an intermediate level and the
    final merge), against the CPU kernels."""
    n0 = 2**31 + 5
    off1 = -(-n0 // 16) * 16  # the optimizer's 64-byte aligned layout: > 2**31
    n1 = 65537
    total = off1 + -(-n1 // 16) * 16
    _require_gpu_memory(n0 * (4 + 2) + total * (4 + 4) + 2**30)
    gen = torch.Generator(device=CUDA).manual_seed(3)
    p0 = torch.empty(n0, device=CUDA).uniform_(-1.0, 1.0, generator=gen)
    g0 = torch.empty(n0, device=CUDA, dtype=torch.bfloat16).normal_(0.0, 4.0, generator=gen)
    p1 = torch.empty(n1, device=CUDA).uniform_(-1.0, 1.0, generator=gen)
    g1 = torch.empty(n1, device=CUDA, dtype=torch.bfloat16).normal_(0.0, 4.0, generator=gen)
    exp_avg = torch.empty(total, device=CUDA).normal_(0.0, 0.01, generator=gen)
    exp_avg_sq = torch.empty(total, device=CUDA).uniform_(0.0, 1e-4, generator=gen)
    steps = torch.tensor([4.0, 9.0], device=CUDA)
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    # The second tensor's state as the CPU kernel will step it, alone.
    cpu = [t.cpu() for t in (p1, g1, exp_avg[off1 : off1 + n1], exp_avg_sq[off1 : off1 + n1])]
    ops.adamw_scaled_(
        [p0, p1], [g0, g1], exp_avg, exp_avg_sq, None, steps,
        torch.tensor([[0, 0], [off1, 1]]), grad_scale=torch.tensor([3.0], device=CUDA),
        **hyper,
    )  # fmt: skip
    assert steps.tolist() == [5.0, 10.0]
    p, g, m, v = cpu
    ops.adamw_scaled_(
        [p], [g], m, v, None, torch.tensor([9.0]), torch.zeros(1, 2, dtype=torch.int64),
        grad_scale=torch.tensor([3.0]), **hyper,
    )  # fmt: skip
    for name, got, expected in (
        ("param", p1, p),
        ("exp_avg", exp_avg[off1 : off1 + n1], m),
        ("exp_avg_sq", exp_avg_sq[off1 : off1 + n1], v),
    ):
        assert same_bits(got.cpu(), expected), f"{name} of the tensor past 2**31"
    del p0, p1, exp_avg, exp_avg_sq
    # The report of both gradients: analyze + two merge levels on each device.
    reports = []
    for grads in ([g0, g1], [g0.cpu(), g1.cpu()]):
        device = grads[0].device
        n_rows = sum(ops.stats_rows_for(t.numel()) for t in grads)
        rows = torch.empty(n_rows, 3, device=device)
        ops.analyze_gradient(grads, rows, torch.tensor([3.0], device=device))
        plan = ruda_torch.StatsPlan(n_rows)
        assert plan.levels == [-(-n_rows // 1024)]
        out = torch.empty(3, device=device)
        plan.reduce(rows, torch.empty(plan.scratch_elements, device=device), out)
        reports.append(out.cpu())
        del rows
    assert same_bits(reports[0], reports[1]), f"report {reports[0]} vs {reports[1]}"
    torch.cuda.empty_cache()


def test_update_grid_is_one_wave_of_resident_blocks(tmp_path):
    """max_resident_blocks sizes the grid by the kernel's real occupancy: SMs x the blocks
    that its registers let one SM hold (2048 / threads would assume no register limit).
    Read from the profiler's record of the launch: grid and block size, registers per
    thread."""
    import json

    from torch.profiler import ProfilerActivity, profile

    props = torch.cuda.get_device_properties(0)
    units = props.multi_processor_count * 8 * 4  # more work units than any one wave
    numel = units * 4096
    p = torch.zeros(numel, device=CUDA)
    g = torch.ones(numel, device=CUDA)
    m, v = torch.zeros(numel, device=CUDA), torch.zeros(numel, device=CUDA)
    steps = torch.zeros(1, device=CUDA)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ops.adamw_scaled_(
            [p], [g], m, v, None, steps, torch.zeros(1, 2, dtype=torch.int64),
            lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
        )  # fmt: skip
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [
        e
        for e in json.loads(trace.read_text())["traceEvents"]
        if e.get("cat") == "kernel" and "adamw_kernel" in e.get("name", "")
    ]
    assert len(events) == 1, [e.get("name") for e in events]
    args = events[0]["args"]
    grid, block, regs = args["grid"][0], args["block"][0], args["registers per thread"]
    per_block = -(-regs * 32 // 256) * 256 * (block // 32)  # registers are allocated per warp
    by_registers = getattr(props, "regs_per_multiprocessor", 65536) // per_block
    expected = props.multi_processor_count * min(by_registers, 2048 // block)
    assert grid == min(units, expected), (grid, regs, expected)


# ------------------------------------------- parameter dtypes (Note [Parameter dtypes])

PARAM_VARIANTS = [
    # (id, parameter dtype, gradient dtype, master weights, stochastic rounding)
    ("bf16", torch.bfloat16, torch.bfloat16, False, False),
    ("bf16-fp32grad", torch.bfloat16, torch.float32, False, False),
    ("bf16-master", torch.bfloat16, torch.bfloat16, True, False),
    ("bf16-sr", torch.bfloat16, torch.bfloat16, False, True),
    ("fp16", torch.float16, torch.float16, False, False),
    ("fp16-master", torch.float16, torch.float32, True, False),
    ("fp64", torch.float64, torch.float64, False, False),
    # BF16 moments (Note [Low-precision states]), stored rounded as the last field says.
    ("fp32-bf16moments", torch.float32, torch.float32, False, False, "stochastic"),
    ("fp32-bf16moments-nearest", torch.float32, torch.bfloat16, False, False, "nearest"),
    ("bf16-sr-bf16moments", torch.bfloat16, torch.bfloat16, False, True, "stochastic"),
    ("fp16-master-bf16moments", torch.float16, torch.float32, True, False, "stochastic"),
]


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("numel", [0, 1, 97, 1025, 65537])
@pytest.mark.parametrize("variant", PARAM_VARIANTS, ids=[v[0] for v in PARAM_VARIANTS])
def test_param_dtype_variants_cuda_match_cpu_bitwise(variant, numel, amsgrad, offset):
    """16-bit parameters (rounded, with masters some of which the parameter no longer
    matches, stochastically rounded), FP64 parameters, BF16 moments and a Tensor lr on the
    device: every kernel variant gives the CPU's bits."""
    _, pdtype, gdtype, master, sr = variant[:5]
    state_rounding = variant[5] if len(variant) > 5 else "stochastic"
    gen = torch.Generator().manual_seed(seed_of("param-variant", variant[0], numel, amsgrad))
    sdtype = torch.float64 if pdtype == torch.float64 else torch.float32
    if len(variant) > 5:
        sdtype = torch.bfloat16
    n = numel + offset
    tensors = {
        "param": torch.randn(n, generator=gen).to(pdtype)[offset:],
        "grad": (torch.randn(n, generator=gen) * 0.3).to(gdtype)[offset:],
        "exp_avg": (torch.randn(numel, generator=gen) * 0.1).to(sdtype),
        "exp_avg_sq": (torch.rand(numel, generator=gen) * 0.01).to(sdtype),
        "max_exp_avg_sq": (torch.rand(numel, generator=gen) * 0.02).to(sdtype) if amsgrad else None,
        "steps": torch.tensor([5.0]),
    }
    if master:
        m = torch.randn(numel, generator=gen)
        tensors["param"].copy_(m.to(pdtype))
        tensors["param"][::5] = torch.randn(len(range(0, numel, 5)), generator=gen).to(pdtype)
        tensors["master"] = m
    results = []
    for device in ("cpu", CUDA):
        t = {k: None if v is None else v.to(device) for k, v in tensors.items()}
        for _ in range(3):
            ops.adamw_scaled_(
                [t["param"]], [t["grad"]], t["exp_avg"], t["exp_avg_sq"], t["max_exp_avg_sq"],
                t["steps"], torch.zeros((1, 2), dtype=torch.int64), lr=0.0, beta1=0.9,
                beta2=0.99, eps=1e-8, weight_decay=0.1, master=t.get("master"),
                lr_tensor=torch.tensor(3e-3, device=device), stochastic_rounding=sr, seed=42,
                state_rounding=state_rounding,
            )  # fmt: skip
        results.append({k: None if v is None else v.cpu() for k, v in t.items()})
    for k in tensors:
        assert same_bits(results[0][k], results[1][k]), f"{k} differs"


@pytest.mark.parametrize("kind", ["transposed", "channels_last", "gapped"])
def test_non_contiguous_params_cuda_optimizer_matches_cpu_bitwise(kind):
    gen = torch.Generator().manual_seed(seed_of("layout-gpu", kind))
    if kind == "transposed":
        base = torch.randn(65, 33, generator=gen).t()
    elif kind == "channels_last":
        base = torch.randn(8, 5, 3, 3, generator=gen).to(memory_format=torch.channels_last)
    else:
        base = torch.randn(10, 5, 2, generator=gen)[..., 0]
    runs = []
    for device in ("cpu", CUDA):
        if kind == "gapped":  # a view with gaps on each device, holding base's values
            data = torch.empty(10, 5, 2, device=device)[..., 0].copy_(base)
        else:  # a copy in base's layout (base itself stays the starting point)
            data = base.clone(memory_format=torch.preserve_format).to(device)
        p = torch.nn.Parameter(data)
        opt = ruda_torch.AdamW([p], lr=1e-2, fused_step=True, amsgrad=True)
        for step in range(3):
            g = torch.randn(base.shape, generator=torch.Generator().manual_seed(step))
            p.grad = torch.empty_like(p).copy_(g.to(device))
            opt.step()
        runs.append(p.detach().cpu().contiguous())
    assert same_bits(runs[0], runs[1])


# ------------------------------------------------------------------ flat gradients, graphs

_FLAT_SIZES = [97, 1025, 65537, 0, 4096]


def _flat_pair(**kwargs):
    """Twin CUDA parameter lists with flat-gradient optimizers, a Tensor lr each."""
    gen = torch.Generator().manual_seed(5)
    base = [torch.randn(n, generator=gen) for n in _FLAT_SIZES]
    out = []
    for _ in range(2):
        params = [torch.nn.Parameter(t.clone().cuda()) for t in base]
        lr = torch.tensor(1e-3, device="cuda")
        opt = ruda_torch.AdamW(params, lr=lr, eps=1e-8, weight_decay=1e-2, fused_step=True,
                               flat_grads=True, **kwargs)  # fmt: skip
        out.append((params, opt, lr))
    return out


def _step_grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=gen).cuda() for n in _FLAT_SIZES]


def _load(params, step: int) -> None:
    for p, g in zip(params, _step_grads(step), strict=True):
        p.grad.copy_(g)  # into the view: the graph reads the same memory every replay


@pytest.mark.parametrize("precision", ["fp32", "bf16", "8bit"])
def test_flat_grads_cuda_match_cpu_bitwise(precision):
    """The flat-gradient path on CUDA (device-resident table) against the same steps on
    the CPU, with a parameter without a gradient in one step (a table subset); with every
    state precision (8-bit: the 1,025-element parameter and the larger ones in codes)."""
    gen = torch.Generator().manual_seed(9)
    base = [torch.randn(n, generator=gen) for n in _FLAT_SIZES]
    runs, states = [], []
    for dev in ("cpu", "cuda"):
        params = [torch.nn.Parameter(t.clone().to(dev)) for t in base]
        opt = ruda_torch.AdamW(params, eps=1e-8, weight_decay=1e-2, fused_step=True,
                               flat_grads=True, amsgrad=True, state_precision=precision,
                               min_8bit_size=1024)  # fmt: skip
        for step in range(5):
            opt.zero_grad()
            for j, (p, g) in enumerate(zip(params, _step_grads(step), strict=True)):
                if not (step == 2 and j == 1):
                    p.grad.copy_(g.to(dev))
            opt.step()
        runs.append(params)
        states.append(opt.state_dict()["state"])
    for a, b in zip(*runs, strict=True):
        assert same_bits(a.detach(), b.detach().cpu())
    for i, entry in states[0].items():
        for key, value in entry.items():
            assert same_bits(value, states[1][i][key].cpu()), (i, key)


@pytest.mark.parametrize(
    "options",
    [{}, dict(hierarchical_stats=True, max_grad_norm=0.5),
     dict(state_precision="8bit", min_8bit_size=1024)],
    ids=["bare", "clipped", "8bit"],
)  # fmt: skip
def test_flat_step_replays_in_a_cuda_graph_bit_for_bit(options):
    """Note [Capturing a step in a CUDA graph]: a captured step replayed with new
    gradients in the views, a Tensor lr decayed between steps and found_inf set on one
    step gives the bits of eager steps, the skipped step skipped under replay too; with
    statistics, the report and the clip are the eager ones at every replay."""
    (pe, eager, lr_e), (pg, graphed, lr_g) = _flat_pair(**options)
    found = [torch.zeros(1, device="cuda") for _ in range(2)]
    scale = [torch.ones(1, device="cuda") for _ in range(2)]
    for opt, f, s in ((eager, found[0], scale[0]), (graphed, found[1], scale[1])):
        opt.found_inf, opt.grad_scale = f, s  # what GradScaler.step hands over
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up steps create the state
        for step in range(2):
            for params, opt in ((pe, eager), (pg, graphed)):
                _load(params, step)
                opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()
    for step in range(2, 9):
        for f in found:
            f.fill_(1.0 if step == 5 else 0.0)
        _load(pg, step)
        graph.replay()
        _load(pe, step)
        eager.step()
        for lr in (lr_e, lr_g):
            lr.mul_(0.9)
        torch.cuda.synchronize()
        for j, (a, b) in enumerate(zip(pe, pg, strict=True)):
            assert same_bits(a.detach(), b.detach()), f"step {step} parameter {j}"
            for key, value in eager.state[a].items():
                assert same_bits(value, graphed.state[b][key]), f"step {step} {j} {key}"
        if options.get("hierarchical_stats"):
            assert same_bits(eager.last_report.tensor, graphed.last_report.tensor)
    assert graphed.state[pg[0]]["step"].item() == 2 + 6  # 7 replays, one skipped


def test_capturing_a_gathered_step_is_refused():
    params = [torch.nn.Parameter(torch.randn(8, device="cuda"))]
    opt = ruda_torch.AdamW(params, fused_step=True)
    params[0].grad = torch.randn(8, device="cuda")
    opt.step()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="flat_grads=True"):
        with torch.cuda.graph(graph):
            opt.step()


@pytest.mark.parametrize("code", ops.CODES_8BIT)
@pytest.mark.parametrize("numel", [0, 1, 97, 256, 1025, 65537, 1 << 22])
def test_quantize_8bit_cuda_matches_cpu_bitwise(code, numel):
    """Blockwise 8-bit codes (Note [8-bit moments] in csrc/quant8.h): codes, scales and
    decoded values on the GPU equal the CPU kernels', with a NaN block and a tiny block."""
    gen = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=gen) * torch.exp(torch.randn(numel, generator=gen) * 3)
    if numel >= 1025:
        x[300] = float("nan")
        x[768:1024] = 1e-39
    if code == "unsigned":
        x = x.abs()
    codes, scales = ops.quantize_8bit(x, code)
    gpu_codes, gpu_scales = ops.quantize_8bit(x.cuda(), code)
    assert torch.equal(gpu_codes.cpu(), codes)
    assert torch.equal(gpu_scales.cpu().view(torch.int32), scales.view(torch.int32))
    decoded = ops.dequantize_8bit(codes, scales, code)
    gpu_decoded = ops.dequantize_8bit(gpu_codes, gpu_scales, code).cpu()
    assert torch.equal(gpu_decoded.view(torch.int32), decoded.view(torch.int32))


@pytest.mark.parametrize("code", ops.CODES_8BIT)
def test_quantize_8bit_every_class_of_value_cuda_matches_cpu(code):
    """The GPU codec (Note [8-bit CUDA encode]: pairs through FP16 toward zero, rounding to
    odd, the signed codes' signs four at a time) on every class of value the codec rounds
    differently (tests/test_cpu_isa.py's inputs): the CPU's codes, scales and decoded values."""
    from test_cpu_isa import _codec_inputs

    x = _codec_inputs(code)
    codes, scales = ops.quantize_8bit(x, code)
    gpu_codes, gpu_scales = ops.quantize_8bit(x.cuda(), code)
    assert torch.equal(gpu_codes.cpu(), codes)
    assert same_bits(gpu_scales.cpu(), scales)
    gpu_decoded = ops.dequantize_8bit(gpu_codes, gpu_scales, code).cpu()
    assert same_bits(gpu_decoded, ops.dequantize_8bit(codes, scales, code))


@pytest.mark.parametrize("code", ops.CODES_8BIT)
def test_dequantize_every_code_cuda_matches_cpu(code):
    """All 256 codes of each kind under every kind of scale decoded on the GPU (Note [8-bit
    CUDA decode]: two codes through FP16, the signed ones by a sign-replicating prmt, the
    product by scale 2^8 below 2^120) as on the CPU, bit for bit; where a scale is a NaN
    (which no step writes) both decode NaN, the GPU's with its own canonical payload."""
    below = torch.tensor(2.0**120).view(torch.int32).sub(1).view(torch.float32).item()
    scales = torch.tensor([1.0, 3.0e38, 1.5e-38, 0.0, 7.25e-3, 2.0**-100, -1.0, -3.0e38, -0.0,
                           -7.25e-3, float("nan"), -float("nan"), 2.0**120, below, 2.0**119,
                           -(2.0**120), 1e-45])  # fmt: skip
    codes = torch.arange(256, dtype=torch.uint8).repeat(scales.numel())
    cpu = ops.dequantize_8bit(codes, scales, code)
    gpu = ops.dequantize_8bit(codes.cuda(), scales.cuda(), code).cpu()
    nan = cpu.isnan()
    assert torch.equal(gpu.isnan(), nan)
    assert same_bits(gpu[~nan], cpu[~nan])


@pytest.mark.parametrize(
    "param_dtype,amsgrad,master,stochastic",
    [(torch.bfloat16, True, False, True), (torch.bfloat16, False, False, False),
     (torch.float16, True, False, False), (torch.bfloat16, False, True, False)],
    ids=["bf16-amsgrad-stochastic", "bf16", "fp16-amsgrad", "bf16-master"],
)  # fmt: skip
def test_adamw_8bit_cuda_special_values_match_cpu_bitwise(param_dtype, amsgrad, master,
                                                          stochastic):  # fmt: skip
    """16-bit parameters with 8-bit moments on the GPU, each launch-uniform choice a kernel of
    its own (Choice8), the parameters rounded a pair at a time (cvt.rn.bf16x2/f16x2, the
    stochastic canonical clamp): +-inf, NaN, subnormal and -0 parameters in both halves of
    pairs, overflowing and subnormal gradients (special blocks), against the CPU's bits."""
    from test_quant8 import STEP_SIZES, _bucket_8bit, _extreme_grads, _step

    params, grads, state, _ = _bucket_8bit(STEP_SIZES, amsgrad, param_dtype, master=master)
    grads = _extreme_grads(
        grads, 1, param_dtype if param_dtype == torch.bfloat16 else torch.float32
    )
    grads = [g.to(param_dtype) for g in grads]
    if not master:
        specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e-40, -0.0])
        for p in params:  # each value at an even and an odd element
            for first in (1, 2)[: max(0, p.numel() - 1)]:
                at = torch.arange(first, p.numel(), 7)[: specials.numel()]
                p[at] = specials[: at.numel()].to(param_dtype)
    gpu_params = [p.cuda() for p in params]
    gpu_grads = [g.cuda() for g in grads]
    gpu_state = {k: (v.cuda() if isinstance(v, torch.Tensor) and k != "slots" else v)
                 for k, v in state.items()}  # fmt: skip
    kw = dict(stochastic_rounding=stochastic, seed=11)
    for _ in range(2):
        _step(params, grads, state, **kw)
        _step(gpu_params, gpu_grads, gpu_state, **kw)
    for p, q in zip(params, gpu_params, strict=True):
        assert same_bits(q.cpu(), p)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert same_bits(gpu_state[key].cpu(), value), key


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize(
    "param_dtype,master",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float16, True)],
    ids=["fp32", "bf16", "fp16-master"],
)
def test_adamw_8bit_cuda_matches_cpu_bitwise(amsgrad, param_dtype, master):
    """8-bit moments (Note [8-bit moments] in csrc/quant8.h): the GPU kernel (a warp per
    block of 256) writes the CPU kernel's parameters, masters, codes, scales and counters."""
    from test_quant8 import STEP_SIZES, _bucket_8bit, _step

    params, grads, state, _ = _bucket_8bit(STEP_SIZES, amsgrad, param_dtype, master=master)
    gpu_params = [p.cuda() for p in params]
    gpu_grads = [g.cuda() for g in grads]
    gpu_state = {k: (v.cuda() if isinstance(v, torch.Tensor) and k != "slots" else v)
                 for k, v in state.items()}  # fmt: skip
    for _ in range(2):
        _step(params, grads, state)
        _step(gpu_params, gpu_grads, gpu_state)
    for p, q in zip(params, gpu_params, strict=True):
        assert torch.equal(p, q.cpu())
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, gpu_state[key].cpu()), key


@pytest.mark.parametrize(
    "dtype,kw",
    [(torch.float32, {}), (torch.float32, {"amsgrad": True, "max_grad_norm": 0.5}),
     (torch.bfloat16, {"master_weights": True}),
     (torch.bfloat16, {"stochastic_rounding": True, "rounding_seed": 7})],
    ids=["fp32", "fp32-amsgrad-clip", "bf16-master", "bf16-stochastic"],
)  # fmt: skip
def test_8bit_optimizer_cuda_matches_cpu_bitwise(dtype, kw):
    """state_precision="8bit" through the optimizer (buckets with the scales apart, an
    FP32 bucket for the small parameters, a transposed parameter, rows that are not whole
    blocks: of 33, and of 300 and 1000 whose whole blocks the rows kernel steps):
    parameters, codes, scales and FP32 moments of CUDA steps equal the CPU's."""
    gen = torch.Generator().manual_seed(4)
    shapes = [(300, 33), (300,), (20, 300), (70, 80), (16, 1000)]
    base = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(3)]
    runs, states = [], []
    for dev in ("cpu", "cuda"):
        params = [torch.nn.Parameter(t.clone().to(dev)) for t in base]
        params[3] = torch.nn.Parameter(base[3].clone().to(dev).t().contiguous().t())
        opt = ruda_torch.AdamW(params, lr=1e-2, fused_step=True, state_precision="8bit",
                               hierarchical_stats=True, **kw)  # fmt: skip
        for step in range(3):
            for p, g in zip(params, grads[step], strict=True):
                p.grad = g.to(dev).clone(memory_format=torch.preserve_format)
            params[3].grad = grads[step][3].to(dev).t().contiguous().t()
            opt.step()
        runs.append(params)
        states.append(opt.state_dict()["state"])
    for a, b in zip(*runs, strict=True):
        assert same_bits(a.detach(), b.detach().cpu())
    assert "exp_avg_codes" in states[0][0] and "exp_avg" in states[0][1]
    for i, entry in states[0].items():
        for key, value in entry.items():
            assert same_bits(value, states[1][i][key].cpu()), (i, key)


@pytest.mark.parametrize("code", ops.CODES_4BIT)
@pytest.mark.parametrize("shape", [(0,), (1,), (98,), (1026,), (65538,), (3, 98), (7, 1030)],
                         ids=str)  # fmt: skip
def test_quantize_4bit_cuda_matches_cpu_bitwise(code, shape):
    """Blockwise 4-bit codes (Note [4-bit CUDA lanes] in csrc/cuda/quant4_lanes.cuh): codes,
    scales and decoded values of the GPU kernels equal the CPU's, with wide magnitudes and
    blocks holding an infinity and a NaN (special codes), flat and by rows."""
    gen = torch.Generator().manual_seed(math.prod(shape))
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)
    flat = x.view(-1)
    if flat.numel() > 700:
        flat[300], flat[600], flat[650] = float("nan"), float("inf"), -float("inf")
    if code == "unsigned":
        x = x.abs()
    codes, scales = ops.quantize_4bit(x, code)
    gpu_codes, gpu_scales = ops.quantize_4bit(x.cuda(), code)
    assert torch.equal(codes, gpu_codes.cpu())
    assert same_bits(scales, gpu_scales.cpu())
    gpu_decoded = ops.dequantize_4bit(gpu_codes, gpu_scales, code).cpu()
    assert same_bits(gpu_decoded, ops.dequantize_4bit(codes, scales, code))


@pytest.mark.parametrize("code", ops.CODES_4BIT)
def test_quantize_4bit_every_class_of_value_cuda_matches_cpu(code):
    """The GPU's FP16 pair encoder (Note [4-bit CUDA encode]) gives the CPU's codes on every
    class of value (tests/test_cpu_isa.py's inputs)."""
    from test_cpu_isa import _codec4_inputs

    x = _codec4_inputs(code)
    codes, scales = ops.quantize_4bit(x, code)
    gpu_codes, gpu_scales = ops.quantize_4bit(x.cuda(), code)
    assert torch.equal(codes, gpu_codes.cpu())
    assert same_bits(scales, gpu_scales.cpu())


@pytest.mark.parametrize(
    "dtype,kw",
    [(torch.float32, {}), (torch.float32, {"amsgrad": True, "max_grad_norm": 0.5}),
     (torch.bfloat16, {"master_weights": "remainder"}),
     (torch.float16, {"master_weights": True, "amsgrad": True}),
     (torch.bfloat16, {"stochastic_rounding": True, "rounding_seed": 7})],
    ids=["fp32", "fp32-amsgrad-clip", "bf16-remainder", "fp16-master-amsgrad", "bf16-stochastic"],
)  # fmt: skip
@pytest.mark.parametrize("flat_grads", [False, True], ids=["grads", "flat-grads"])
def test_4bit_optimizer_cuda_matches_cpu_bitwise(dtype, kw, flat_grads):
    """state_precision="4bit" through the optimizer on CUDA (Note [4-bit CUDA step]): rows of
    whole blocks, rows that are not (130 and 1000: whole blocks in the rows kernel, the rest
    in the edge kernel), an odd last dimension (8-bit), a small bias (FP32) and a transposed
    parameter; parameters, codes, scales, masters and counters equal the CPU's after every
    step."""
    gen = torch.Generator().manual_seed(6)
    shapes = [(300, 36), (20, 130), (33, 129), (300,), (256, 64), (70, 80), (16, 1000)]
    base = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(3)]
    runs, states = [], []
    for dev in ("cpu", "cuda"):
        params = [torch.nn.Parameter(t.clone().to(dev)) for t in base]
        params[5] = torch.nn.Parameter(base[5].clone().to(dev).t().contiguous().t())
        opt = ruda_torch.AdamW(params, lr=1e-2, fused_step=True, state_precision="4bit",
                               min_8bit_size=1000, flat_grads=flat_grads, **kw)  # fmt: skip
        for step in range(3):
            for p, g in zip(params, grads[step], strict=True):
                if p.grad is None or not flat_grads:
                    p.grad = g.to(dev).clone(memory_format=torch.preserve_format)
                else:
                    p.grad.copy_(g.to(dev))
            opt.step()
        runs.append(params)
        states.append(opt.state_dict()["state"])
    for a, b in zip(*runs, strict=True):
        assert same_bits(a.detach(), b.detach().cpu())
    assert "exp_avg_codes4" in states[0][1] and "exp_avg_codes" in states[0][2]
    for i, entry in states[0].items():
        for key, value in entry.items():
            assert same_bits(value, states[1][i][key].cpu()), (i, key)
