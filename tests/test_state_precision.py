"""Low-precision optimizer states: ``state_precision="bf16"`` (Note [Low-precision states]
in csrc/adamw_math.h).

The BF16-moment update is defined bit for bit: the FP32 update of the moments widened
exactly from BF16 (the FP32 kernel, itself checked against torch and the FP64 reference
in test_ops.py), the parameter written from the moments before rounding, and each moment
stored rounded to nearest even (torch's conversion) or stochastically with the
counter-based bits that a reference of the hash here recomputes in Python. The optimizer
tests compare with the FP32-state optimizer and torch.optim.AdamW through checkpoints,
skipped steps, flat gradients, statistics and clipping, and option changes.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from optim_harness import copy_grads, step_twin
from test_ops import same_bits, seed_of

import ruda_torch
from ruda_torch import ops

SIZES = [0, 1, 97, 1025, 65537]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
MASK64 = 2**64 - 1
# Moment streams of csrc/adamw_math.h (enum class Moment), and which half of the draw
# each moment rounds with (Note [Low-precision states]).
AVERAGES, MAXIMUM = 0x6578705F61766731, 0x6D61785F61767371
MOMENT_STREAMS = {
    "exp_avg": (AVERAGES, 0),
    "exp_avg_sq": (AVERAGES, 16),
    "max_exp_avg_sq": (MAXIMUM, 0),
}


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(seed_of(*parts))


# ------------------------------------------------- a Python reference of the rounding bits


def rounding_key(seed: int, t: int) -> int:
    """SplitMix64's finalizer of (seed, t), high 32 bits (Note [Stochastic rounding bits])."""
    z = (seed + t * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((z ^ (z >> 31)) & MASK64) >> 32


def rounding_bits(key: int, index: np.ndarray) -> np.ndarray:
    i = index.astype(np.uint64)
    lo, hi = (i & 0xFFFFFFFF).astype(np.uint32), (i >> np.uint64(32)).astype(np.uint32)
    with np.errstate(over="ignore"):
        h = (lo * np.uint32(0x9E3779B1)) ^ (hi * np.uint32(0x85EBCA77))
        h ^= np.uint32(key)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h


def round_stochastic(x: torch.Tensor, key: int, first_index: int, shift: int) -> torch.Tensor:
    """BF16 bits of the FP32 values ``x`` of elements first_index, first_index + 1, ...,
    with the 16 bits at ``shift`` of each element's draw; round_bf16_stochastic of
    adamw_math.h."""
    bits = x.contiguous().view(torch.int32).numpy().view(np.uint32)
    r = rounding_bits(key, np.arange(first_index, first_index + x.numel(), dtype=np.uint64))
    r = r >> np.uint32(shift)
    ax = bits & np.uint32(0x7FFFFFFF)
    add = np.where(ax == np.uint32(0x7F800000), np.uint32(0), r & np.uint32(0xFFFF))
    with np.errstate(over="ignore"):
        out = ((bits + add) >> np.uint32(16)).astype(np.uint16)
    out = np.where(ax > np.uint32(0x7F800000), np.uint16(0x7FFF), out)
    result = torch.empty(x.numel(), dtype=torch.int16)
    result.copy_(torch.from_numpy(out.astype(np.int16)))
    return result.view(torch.bfloat16)


def round_nearest(x: torch.Tensor) -> torch.Tensor:
    """torch's round to nearest even, with the kernels' one NaN (Note [Canonical NaN])."""
    out = x.to(torch.bfloat16)
    out.view(torch.int16)[torch.isnan(x)] = 0x7FFF
    return out


def expected_moment(x, name, rounding, seed, t, first_index=0):
    if rounding == "nearest":
        return round_nearest(x)
    stream, shift = MOMENT_STREAMS[name]
    key = rounding_key((seed & MASK64) ^ stream, t)
    return round_stochastic(x, key, first_index, shift)


# --------------------------------------------------------------- the operator, bit for bit


def _state(gen, n, amsgrad, dtype=torch.bfloat16):
    m = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    v = (torch.rand(n, generator=gen) * 0.01).to(dtype)
    vm = (
        (v.float() * torch.empty(n).uniform_(0.5, 1.5, generator=gen)).to(dtype)
        if amsgrad
        else None
    )
    return m, v, vm


def _widen(t):
    return None if t is None else t.float()


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    base = torch.empty(t.numel() + 1, dtype=t.dtype)
    return base[1:].copy_(t.reshape(-1))


@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_bf16_moments_are_the_fp32_update_rounded(n, pdtype, amsgrad, rounding, unaligned):
    gen = _gen("bf16-state", n, str(pdtype), amsgrad, rounding, unaligned)
    param = torch.randn(n, generator=gen).to(pdtype)
    grad = (torch.randn(n, generator=gen) * 0.3).to(pdtype)
    grad[5::41] = float("nan")  # NaN and infinite moments round as their scalar rule says
    grad[7::53] = float("inf")
    grad[9::59] = -float("inf")
    if unaligned:
        param, grad = _unaligned(param), _unaligned(grad)
    m, v, vm = _state(gen, n, amsgrad)
    steps, slots = torch.tensor([3.0]), torch.zeros((1, 2), dtype=torch.int64)
    ref_param, ref_steps = param.clone(), steps.clone()
    rm, rv, rvm = _widen(m), _widen(v), _widen(vm)
    seed = 2**64 - 77
    kw = dict(**HYPER, maximize=amsgrad, grad_scale=torch.tensor([2.0]), seed=seed)
    ops.adamw_scaled_([param], [grad], m, v, vm, steps, slots, state_rounding=rounding, **kw)
    ops.adamw_scaled_([ref_param], [grad], rm, rv, rvm, ref_steps, slots, **kw)
    assert same_bits(param, ref_param), "the parameter is updated from the FP32 moments"
    assert same_bits(steps, ref_steps)
    t = int(steps.item())
    for name, got, want in (("exp_avg", m, rm), ("exp_avg_sq", v, rv), ("max_exp_avg_sq", vm, rvm)):
        if got is not None:
            assert same_bits(got, expected_moment(want, name, rounding, seed, t)), name


def test_stochastic_moments_use_the_state_offset_and_their_own_streams():
    """Two parameters in one bucket: each element's bits come from its position in the
    flat state; the three moments draw from different streams."""
    gen = _gen("offsets")
    sizes = [33, 100]
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen) for n in sizes]
    total = 160
    m, v, vm = _state(gen, total, True)
    ref = [t.float() for t in (m, v, vm)]
    gap = m[33:48].clone()
    steps = torch.tensor([0.0, 5.0])
    slots = torch.tensor([[0, 0], [48, 1]])
    ref_params = [p.clone() for p in params]
    ops.adamw_scaled_(params, grads, m, v, vm, steps, slots, **HYPER, seed=9)
    ops.adamw_scaled_(ref_params, grads, *ref, steps.clone(), slots, **HYPER, seed=9)
    for (off, t), n in zip([(0, 1), (48, 6)], sizes, strict=True):  # (slot offset, step)
        for name, got, want in zip(MOMENT_STREAMS, (m, v, vm), ref, strict=True):
            exp = expected_moment(want[off : off + n], name, "stochastic", 9, t, off)
            assert same_bits(got[off : off + n], exp), f"{name} at offset {off}"
    assert same_bits(m[33:48], gap), "the gap between the slices is nobody's: untouched"


def test_nearest_rounding_stalls_a_bf16_second_moment_and_stochastic_does_not():
    """Note [Low-precision states]: with beta2 = 0.999 and no gradient, v falls by 0.1%
    a step, below half a BF16 ulp: nearest rounding keeps v at its start for ever, while
    stochastic rounding follows 0.999^t on average."""
    n, steps = 65536, 200

    def run(rounding):
        v = torch.ones(n, dtype=torch.bfloat16)
        m = torch.zeros(n, dtype=torch.bfloat16)
        p, g = torch.zeros(n), torch.zeros(n)
        counter, slots = torch.tensor([0.0]), torch.zeros((1, 2), dtype=torch.int64)
        for _ in range(steps):
            ops.adamw_scaled_([p], [g], m, v, None, counter, slots, lr=0.0, beta1=0.9,
                              beta2=0.999, eps=1e-8, weight_decay=0.0, state_rounding=rounding)  # fmt: skip
        return v.double()

    truth = 0.999**steps
    assert bool((run("nearest") == 1.0).all()), "nearest: stalled at 1"
    mean = run("stochastic").mean().item()
    assert abs(mean - truth) < 2e-3 * truth, (mean, truth)


def test_bf16_moments_are_refused_for_float64_and_mixed():
    p, g = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    m = torch.zeros(16, dtype=torch.bfloat16)
    steps, slots = torch.zeros(1), torch.zeros((1, 2), dtype=torch.int64)
    with pytest.raises(RuntimeError, match="exp_avg must be float64"):
        ops.adamw_scaled_([p], [g], m, m.clone(), None, steps, slots, **HYPER)
    p, g = torch.randn(5), torch.randn(5)
    with pytest.raises(RuntimeError, match="exp_avg_sq must be bfloat16"):
        ops.adamw_scaled_([p], [g], m, torch.zeros(16), None, steps, slots, **HYPER)
    with pytest.raises(RuntimeError, match="max_exp_avg_sq must be bfloat16"):
        ops.adamw_scaled_([p], [g], m, m.clone(), torch.zeros(16), steps, slots, **HYPER)
    with pytest.raises(ValueError, match="state_rounding must be one of"):
        ops.adamw_scaled_([p], [g], m, m.clone(), None, steps, slots, **HYPER, state_rounding="up")


# ----------------------------------------------------------------------- the optimizer


class _Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(33, 97).to(dtype)
        self.b = torch.nn.Linear(97, 5).to(dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.to(self.a.weight.dtype))))


def _train(model, opt, steps, start=0, twin=None, scaler=None):
    """``steps`` steps of ``opt``; ``twin``: a (model, optimizer) pair stepped beside it
    from the same gradients, unscaled where ``scaler`` scales ``model``'s (Note [Twins
    share gradients] in tests/optim_harness.py; a power-of-two scale divides exactly)."""
    for s in range(start, start + steps):
        x = torch.randn(16, 33, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        (loss if scaler is None else scaler.scale(loss)).backward()
        if twin is not None:
            step_twin(model, twin, scaler)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()


def _make(model, **kw):
    kw = {"lr": 1e-2, "fused_step": True, "state_precision": "bf16", **kw}
    return ruda_torch.AdamW(model.parameters(), **kw)


def _params_bits(model):
    return [p.detach().clone() for p in model.parameters()]


def _assert_same_model(a, b):
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert same_bits(x.detach(), y.detach())


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_state_is_bf16_and_close_to_fp32_state(amsgrad):
    model, ref = _Net(), _Net()
    opt, ropt = _make(model, amsgrad=amsgrad), _make(ref, amsgrad=amsgrad, state_precision="fp32")
    _train(model, opt, 30)
    _train(ref, ropt, 30)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        st = opt.state[p]
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
        assert all(st[k].dtype == torch.bfloat16 and st[k].shape == p.shape for k in keys)
        assert st["step"].dtype == torch.float32 and st["step"].item() == 30
        # BF16 keeps 8 bits: 30 steps at lr 1e-2 stay within a few lr-sized steps' noise.
        assert (p - q).abs().max().item() < 2e-2


def test_checkpoint_resumes_bit_for_bit_through_torch_save():
    model, twin = _Net(), _Net()
    opt = _make(model, amsgrad=True, rounding_seed=11)
    _train(model, opt, 5)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf)  # weights_only=True: the state holds plain tensors
    twin.load_state_dict(ck["model"])
    topt = _make(twin, amsgrad=True, rounding_seed=11)
    topt.load_state_dict(ck["opt"])
    assert next(iter(ck["opt"]["state"].values()))["exp_avg"].dtype == torch.bfloat16
    _train(model, opt, 5, start=5, twin=(twin, topt))
    _assert_same_model(model, twin)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert same_bits(opt.state[p][k], topt.state[q][k])


def test_checkpoints_cross_with_torch_adamw():
    """torch.optim.AdamW's FP32 moments load rounded to nearest; ours load into torch
    widened (torch casts state to the parameter's dtype)."""
    model, tm = _Net(), _Net()
    topt = torch.optim.AdamW(tm.parameters(), lr=1e-2)
    _train(tm, topt, 4)
    opt = _make(model)
    model.load_state_dict(tm.state_dict())
    opt.load_state_dict(topt.state_dict())
    _train(model, opt, 1, start=4)  # the load is adopted at the step
    for p in model.parameters():
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        assert opt.state[p]["step"].item() == 5
    # Before our step, the adopted moments were torch's rounded to nearest:
    opt2 = _make(_Net())
    opt2.load_state_dict(topt.state_dict())
    m2 = opt2.param_groups[0]["params"]
    opt2._current_plan()
    for p, q in zip(m2, tm.parameters(), strict=True):
        assert same_bits(opt2.state[p]["exp_avg"], topt.state[q]["exp_avg"].to(torch.bfloat16))
    # Ours into torch: widened exactly.
    back = torch.optim.AdamW(_Net().parameters(), lr=1e-2)
    back.load_state_dict(opt.state_dict())
    for (_, st), p in zip(back.state.items(), model.parameters(), strict=True):
        assert st["exp_avg"].dtype == torch.float32
        assert same_bits(st["exp_avg"], opt.state[p]["exp_avg"].float())


def test_skipped_step_leaves_the_bf16_state_untouched():
    model = _Net()
    opt = _make(model, hierarchical_stats=True, max_grad_norm=1.0)
    _train(model, opt, 3)
    before = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    params = _params_bits(model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    next(model.parameters()).grad[0] = float("inf")
    opt.step()
    assert opt.last_report.nonfinite_count > 0
    for p, q, st in zip(model.parameters(), params, before, strict=True):
        assert same_bits(p.detach(), q)
        for k, v in st.items():
            assert same_bits(opt.state[p][k], v), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_flat_grads_give_the_bits_of_gathered_grads(dtype):
    a, b = _Net(dtype), _Net(dtype)
    kw = dict(master_weights=dtype == torch.bfloat16, max_grad_norm=0.5, hierarchical_stats=True)
    oa, ob = _make(a, flat_grads=True, **kw), _make(b, **kw)
    _train(a, oa, 6, twin=(b, ob))
    _assert_same_model(a, b)


def test_grad_scaler_steps_match_unscaled_steps():
    a, b = _Net(), _Net()
    oa, ob = _make(a), _make(b)
    scaler = ruda_torch.amp.GradScaler("cpu", init_scale=1024.0)
    _train(a, oa, 4, twin=(b, ob), scaler=scaler)
    assert scaler.get_scale() == 1024.0  # no step was skipped
    _assert_same_model(a, b)


def test_changing_state_precision_converts_the_state():
    model = _Net()
    opt = _make(model, state_precision="fp32")
    _train(model, opt, 3)
    fp32 = [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    opt.param_groups[0]["state_precision"] = "bf16"
    opt.param_groups[0]["state_rounding"] = "nearest"
    opt._current_plan()
    for p, v in zip(model.parameters(), fp32, strict=True):
        assert same_bits(opt.state[p]["exp_avg_sq"], v.to(torch.bfloat16))
    _train(model, opt, 1, start=3)
    opt.param_groups[0]["state_precision"] = "fp32"
    _train(model, opt, 1, start=4)
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in model.parameters())


def test_compiled_step_gives_eager_bits():
    """torch.compile(opt.step) (Note [Steps under torch.compile] in optimizer.py)."""
    torch._dynamo.reset()
    a, b = _Net(), _Net()
    oa, ob = _make(a, rounding_seed=2), _make(b, rounding_seed=2)
    compiled = torch.compile(oa.step)
    for s in range(4):
        x = torch.randn(16, 33, generator=torch.Generator().manual_seed(s))
        oa.zero_grad()
        a(x).pow(2).mean().backward()
        copy_grads(a, b)  # Note [Twins share gradients] in tests/optim_harness.py
        compiled()
        ob.step()
    _assert_same_model(a, b)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert same_bits(oa.state[p]["exp_avg_sq"], ob.state[q]["exp_avg_sq"])


def test_options_are_validated():
    p = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="state_precision must be one of"):
        ruda_torch.AdamW([p], fused_step=True, state_precision="fp8")
    with pytest.raises(ValueError, match="requires fused_step=True"):
        ruda_torch.AdamW([p], state_precision="bf16")
    with pytest.raises(ValueError, match="state_rounding must be one of"):
        ruda_torch.AdamW([p], fused_step=True, state_precision="bf16", state_rounding="up")
    q = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="is for float32, float16 and bfloat16"):
        ruda_torch.AdamW([q], fused_step=True, state_precision="bf16")
    # Set on the group after construction: refused at the step, before anything is written.
    opt = ruda_torch.AdamW([q], fused_step=True)
    q.grad = torch.randn_like(q)
    opt.param_groups[0]["state_precision"] = "bf16"
    before = q.detach().clone()
    with pytest.raises(ValueError, match="is for float32, float16 and bfloat16"):
        opt.step()
    assert same_bits(q.detach(), before) and not opt.state


def test_state_bytes_per_element_are_halved():
    model = _Net()
    opt = _make(model, amsgrad=True)
    _train(model, opt, 1)
    numel = sum(p.numel() for p in model.parameters())
    state_bytes = sum(
        v.numel() * v.element_size()
        for p in model.parameters()
        for k, v in opt.state[p].items()
        if k != "step"
    )
    assert state_bytes == 3 * 2 * numel


# ------------------------------------------------------------------- sharded (2 ranks)


def _low_bit_model(precision: str) -> dict:
    """The optimizer keywords of a low-bit precision, and for 4 bits the tests' model with
    even in-features (8, 14, 6 -> 4), whose weights' rows pair into bytes (an odd last
    dimension keeps 8 bits: Note [4-bit buckets] in ruda_torch/_state4bit.py) and an even
    number of elements per rank in FSDP1's flat parameter (244 over 2 ranks). Called first
    in each rank's scenario: the widths are test_distributed's globals, per process."""
    if precision == "4bit":
        import test_distributed as td

        td.IN_FEATURES, td.HIDDEN1, td.HIDDEN2, td.OUT_FEATURES = 8, 14, 6, 4
    # The tests' model is small: every parameter in low bits.
    return dict(min_8bit_size=1) if precision in ("8bit", "4bit") else {}


def _stored_forms(st: dict) -> set[str]:
    """Which forms a parameter's moments are stored in: "fp32", "bf16", "8bit", "4bit"."""
    out = set()
    for key in ("exp_avg", "exp_avg_sq"):
        if key + "_codes4" in st:
            out.add("4bit")
        elif key + "_codes" in st:
            out.add("8bit")
        else:
            dtype = (st[key].to_local() if hasattr(st[key], "to_local") else st[key]).dtype
            out.add("bf16" if dtype == torch.bfloat16 else "fp32")
    return out


def scenario_low_precision_sharded(
    rank: int, workdir: str, setup: str, flow: str, precision: str = "bf16"
) -> None:
    """BF16 or 8-bit moments under FSDP: the state is BF16 views of the local shard, or
    8-bit codes and scales (DTensors for FSDP2), a checkpoint taken by the flow resumes
    bit for bit, a skipped step leaves everything as it was."""
    import os

    from test_distributed import (
        SAVE_AFTER,
        STEPS,
        _local,
        assert_same_bits,
        backward,
        build,
        local_params,
        local_state,
        resume_bit_for_bit,
        train,
    )  # fmt: skip

    kw = dict(state_precision=precision, rounding_seed=5, **_low_bit_model(precision))
    path = os.path.join(workdir, f"ckpt-{flow}")
    model, opt = build(setup, **kw)
    train(model, opt, range(SAVE_AFTER), rank)
    forms = set()
    for p in model.parameters():
        st = opt.state.get(p)
        if st:
            # A 1-D DTensor keeps FP32 moments (Note [8-bit blocks on every mesh] in
            # ruda_torch/_state8bit.py).
            if precision in ("8bit", "4bit") and p.dim() < 2 and hasattr(p, "to_local"):
                assert _local(st["exp_avg"]).dtype == torch.float32
                continue
            forms |= _stored_forms(st)
            for key in ("exp_avg", "exp_avg_sq"):
                if precision == "bf16":
                    keys, dtypes = [key], [torch.bfloat16]
                elif key + "_codes4" in st:  # 4-bit where the last dimension is even
                    keys, dtypes = [key + "_codes4", key + "_scales4"], [torch.uint8, torch.float32]
                else:
                    keys, dtypes = [key + "_codes", key + "_scales"], [torch.uint8, torch.float32]
                for k, dtype in zip(keys, dtypes, strict=True):
                    assert _local(st[k]).dtype == dtype, k
                    assert hasattr(st[k], "to_local") == hasattr(p, "to_local"), k  # DTensors
    # Not vacuous: the precision asked for is what the state holds (4 bits with 8 beside).
    assert precision in forms or not forms, forms
    fresh, fresh_opt, expected_params, expected_state = resume_bit_for_bit(
        flow, setup, model, opt, path, rank, **kw
    )
    # A non-finite gradient on one rank skips every rank's step.
    backward(fresh, STEPS, rank)
    if rank == 1:
        g = next(_local(p.grad) for p in fresh.parameters()
                 if p.grad is not None and _local(p.grad).numel())  # fmt: skip
        g.view(-1)[0] = float("nan")
    fresh_opt.step()
    assert fresh_opt.last_report.skipped.item()
    assert_same_bits(local_params(fresh), expected_params, "parameters after a skip")
    assert_same_bits(local_state(fresh, fresh_opt), expected_state, "state after a skip")


@pytest.mark.parametrize("precision", ["bf16", "8bit", "4bit"])
@pytest.mark.parametrize(
    "setup,flow", [("fsdp2", "dcp-sharded"), ("hsdp", "dcp-sharded"),
                   ("fsdp1", "fsdp1-optim-state-dict"), ("fsdp1-orig-params", "dcp-sharded")],
    ids=str,
)  # fmt: skip
def test_low_precision_moments_under_fsdp_resume_bit_for_bit(tmp_path, setup, flow, precision):
    from test_distributed import run_scenario

    run_scenario(tmp_path, "test_state_precision:scenario_low_precision_sharded", setup=setup,
                 flow=flow, precision=precision)  # fmt: skip


def scenario_low_precision_zero(rank: int, workdir: str, precision: str) -> None:
    """ZeroRedundancyOptimizer around ruda_torch.AdamW with BF16 or 8-bit moments: each
    rank's partition keeps them, and the consolidated checkpoint loaded into an optimizer
    that stepped past it resumes bit for bit."""
    from test_distributed import assert_same_bits, zero_resume

    kw = _low_bit_model(precision)
    straight, resumed, opt = zero_resume(rank, ruda_torch.AdamW, fused_step=True,
                                         state_precision=precision, **kw)  # fmt: skip
    local = opt.optim.state
    assert local
    if precision == "bf16":
        assert all(st["exp_avg"].dtype == torch.bfloat16 for st in local.values())
    else:
        forms = set().union(*(_stored_forms(st) for st in local.values()))
        assert precision in forms and forms <= {"8bit", "4bit"}, forms
    assert_same_bits(resumed, straight, "ZeRO resume")


@pytest.mark.parametrize("precision", ["bf16", "8bit", "4bit"])
def test_low_precision_moments_under_zero_resume_bit_for_bit(tmp_path, precision):
    from test_distributed import run_scenario

    run_scenario(tmp_path, "test_state_precision:scenario_low_precision_zero",
                 precision=precision)  # fmt: skip


def _fsdp2(precision: str):
    """The tests' model under FSDP2 over all ranks, and a BF16- or 8-bit-moment optimizer."""
    import torch.distributed as dist
    from test_distributed import HP, make_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    kw = _low_bit_model(precision)  # first: the widths make_model reads
    model = make_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = ruda_torch.AdamW(model.parameters(), **HP, fused_step=True, state_precision=precision,
                           hierarchical_stats=True, max_grad_norm=1.0, **kw)  # fmt: skip
    return model, opt


def _full_state(opt) -> list[dict]:
    """Every parameter's state, unsharded (a collective), in parameter order."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append({k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
                        for k, v in opt.state[p].items()})  # fmt: skip
    return out


def scenario_dcp_save(rank: int, workdir: str, path: str, precision: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from test_distributed import SAVE_AFTER, train
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt = _fsdp2(precision)
    train(model, opt, range(SAVE_AFTER), rank)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    full = _full_state(opt)
    if rank == 0:
        torch.save(full, path + ".full")
    dist.barrier()


def scenario_dcp_load(rank: int, workdir: str, path: str, precision: str) -> None:
    import torch.distributed.checkpoint as dcp
    from test_distributed import SAVE_AFTER, STEPS, train
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = _fsdp2(precision)
    sd = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, sd["optim"])
    expected = torch.load(path + ".full")
    got = _full_state(opt)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.keys() == e.keys()
        for key, value in e.items():
            assert same_bits(g[key], value), key
        if precision == "bf16":
            assert g["exp_avg"].dtype == torch.bfloat16
    train(model, opt, range(SAVE_AFTER, STEPS), rank)  # and it trains on


@pytest.mark.parametrize("precision", ["bf16", "8bit", "4bit"])
def test_dcp_checkpoint_on_another_number_of_ranks(tmp_path, precision):
    """Saved by 2 FSDP2 ranks, loaded by 1: DCP reshards the DTensors, and the moments (BF16,
    or 8-bit codes and scales, whose blocks are the rows': Note [8-bit blocks on every
    mesh] in ruda_torch/_state8bit.py) and counters are the saved ones bit for bit. (The
    steps after it draw other stochastic rounding bits than a 2-rank continuation: an
    element's bits follow its position in its rank's bucket.) tests/test_state_8bit_mesh.py
    takes 8-bit checkpoints through 4 -> 2 -> 1 -> 4 ranks."""
    from test_distributed import run_scenario

    path = str(tmp_path / "ckpt")
    (tmp_path / "two").mkdir()
    (tmp_path / "one").mkdir()
    run_scenario(tmp_path / "two", "test_state_precision:scenario_dcp_save", world=2, path=path,
                 precision=precision)  # fmt: skip
    run_scenario(tmp_path / "one", "test_state_precision:scenario_dcp_load", world=1, path=path,
                 precision=precision)  # fmt: skip
