"""state_precision="8bit" in the optimizer: blockwise 8-bit moments (Note [8-bit buckets]
in ruda_torch/_state8bit.py, Note [8-bit state entries] in ruda_torch/_state8bit.py).

The oracle of a step is the algorithm itself, composed of parts tested on their own
(tests/test_quant8.py: the codec against the FP64 reference, the fused 8-bit kernel
against the FP32 kernel on decoded moments): decode every moment of the state, take one
FP32 fused step of ruda_torch.AdamW, code the new moments with ops.quantize_8bit (blocks of
the rows: Note [8-bit row blocks] in csrc/quant8.h). Parameters, masters, codes, scales
and counters must match bit for bit, through every option of the optimizer that the test
names.
"""

from __future__ import annotations

import io

import pytest
import torch
from optim_harness import copy_grads, step_twin
from test_ops import same_bits
from torch import nn

import ruda_torch
from ruda_torch import ops
from ruda_torch._common import EIGHT_BIT_KEYS, codes_key, scales_key

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class _Net(nn.Module):
    """Parameters of both kinds: 8-bit ((300, 33) and (20, 300): rows of 33 and 300
    elements, one block and one and a bit, so slots laid out in rows; an (80, 70)
    transposed one of 5,600, dense but not contiguous, stepped through a contiguous copy)
    and FP32 (the biases, below min_8bit_size)."""

    def __init__(self, dtype=torch.float32, hidden=300, cols=70, inputs=33, transposed=True):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(inputs, hidden).to(dtype)
        self.b = nn.Linear(hidden, 20).to(dtype)
        t = (torch.randn(cols, 80) / 9).to(dtype).t()
        self.t = nn.Parameter(t if transposed else t.contiguous())

    def forward(self, x):
        h = torch.tanh(self.a(x.to(self.a.weight.dtype)))
        return self.b(h).float().pow(2).mean() + (h[:, :80] @ self.t).float().pow(2).mean()


def _batch(s: int, inputs: int = 33) -> torch.Tensor:
    return torch.randn(16, inputs, generator=torch.Generator().manual_seed(s))


def _backward(model, s: int) -> None:
    model(_batch(s, model.a.in_features)).backward()


def _make(model, **kw):
    kw = {"lr": 1e-2, "fused_step": True, "state_precision": "8bit", **kw}
    return ruda_torch.AdamW(model.parameters(), **kw)


def _train(model, opt, steps, start=0, twin=None, scaler=None):
    """``steps`` steps of ``opt``; ``twin``: a (model, optimizer) pair stepped beside it
    from the same gradients, unscaled where ``scaler`` scales ``model``'s (Note [Twins
    share gradients] in tests/optim_harness.py; a power-of-two scale divides exactly)."""
    for s in range(start, start + steps):
        opt.zero_grad()
        loss = model(_batch(s, model.a.in_features))
        (loss if scaler is None else scaler.scale(loss)).backward()
        if twin is not None:
            step_twin(model, twin, scaler)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()


def _quantized(values: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What an 8-bit entry holds for FP32 moment ``values``: the blocks of its rows."""
    code = "signed" if key == "exp_avg" else "unsigned"
    return ops.quantize_8bit(values.contiguous(), code)


def _decoded_state(opt) -> dict:
    """Every parameter's state entry with its 8-bit moments decoded (FP32), cloned."""
    sd = ruda_torch.dequantize_state_dict({"state": dict(opt.state), "param_groups": []})
    return {p: {k: v.clone() for k, v in st.items()} for p, st in sd["state"].items()}


def _oracle_step(model, opt, s: int, cls=ruda_torch.AdamW, edit_grads=None, **kw) -> None:
    """One step of ``opt`` (made with ``kw`` and state_precision="8bit") against the
    oracle of the module docstring, from the current state: bit for bit. ``edit_grads``
    changes both models' gradients before their steps."""
    # The twin's t contiguous: 8-bit moments step a transposed t through a contiguous copy
    # (row-major), whose gradient statistics sum in that order.
    twin = _Net(model.a.weight.dtype, model.a.out_features, model.t.shape[1],
                model.a.in_features, transposed=False)  # fmt: skip
    with torch.no_grad():
        for q, p in zip(twin.parameters(), model.parameters(), strict=True):
            q.copy_(p)
    # Two groups, so that the twin has our buckets in our order: the 8-bit parameters',
    # then the small ones' (a global norm sums its buckets' reports in that order).
    min_size = kw.get("min_8bit_size", 4096)
    big = [q for q in twin.parameters() if q.numel() >= min_size]
    small = [q for q in twin.parameters() if q.numel() < min_size]
    groups = [{"params": ps} for ps in (big, small) if ps]
    twin_opt = cls(groups, **{"lr": 1e-2, "fused_step": True, **kw})
    decoded = _decoded_state(opt)
    for q, p in zip(twin.parameters(), model.parameters(), strict=True):
        if p in decoded:
            twin_opt.state[q] = decoded[p]
    # The twin's gradients are copies of the model's (Note [Twins share gradients] in
    # tests/optim_harness.py): its own backward through the other layout of t may round a
    # BF16 weight's gradient otherwise.
    opt.zero_grad()
    _backward(model, s)
    if edit_grads is not None:
        edit_grads(model)
    twin_opt.zero_grad()
    copy_grads(model, twin)
    opt.step()
    twin_opt.step()
    for q, p in zip(twin.parameters(), model.parameters(), strict=True):
        assert same_bits(p.detach(), q.detach()), f"parameter at step {s}"
        mine, want = opt.state[p], twin_opt.state[q]
        assert same_bits(mine["step"], want["step"])
        if "master_param" in want:
            assert same_bits(mine["master_param"], want["master_param"])
        for key in MOMENTS:
            if key not in want:
                assert key not in mine and codes_key(key) not in mine
                continue
            if p.numel() < min_size:
                assert same_bits(mine[key], want[key]), key
                continue
            codes, scales = _quantized(want[key], key)
            assert same_bits(mine[codes_key(key)], codes), f"{key} codes at {s}"
            assert same_bits(mine[scales_key(key)], scales), f"{key} scales at {s}"


OPTIONS = {
    "adamw": {},
    "amsgrad": {"amsgrad": True},
    "flat-clip": {"flat_grads": True, "hierarchical_stats": True, "max_grad_norm": 0.05},
    "tensor-norm-clip": {"max_grad_norm": 0.05, "weight_decay": 0.1},
    "maximize": {"maximize": True, "amsgrad": True},
    "tensor-lr": {"lr": torch.tensor(3e-3)},
}


@pytest.mark.parametrize("options", list(OPTIONS), ids=str)
def test_8bit_steps_are_fp32_steps_on_decoded_moments(options):
    kw = OPTIONS[options]
    model = _Net()
    opt = _make(model, **kw)
    for s in range(4):
        _oracle_step(model, opt, s, **kw)
    st = opt.state[model.a.weight]
    assert st[codes_key("exp_avg")].dtype == torch.uint8 and "exp_avg" not in st
    assert st[codes_key("exp_avg")].shape == model.a.weight.shape
    assert st[scales_key("exp_avg")].shape == (300, 1)  # a block per row of 33
    assert opt.state[model.b.weight][scales_key("exp_avg")].shape == (20, 2)
    assert opt.state[model.a.bias]["exp_avg"].dtype == torch.float32  # below min_8bit_size
    t = opt.state[model.t][codes_key("exp_avg_sq")]
    assert t.shape == model.t.shape and t.is_contiguous()  # row-major, a code per element


FLT_MAX = torch.finfo(torch.float32).max
# Finite gradients whose moments overflow or underflow FP32: 1e19 squares to 1e38, 1e30 and
# FLT_MAX to inf, 1e-40 (subnormal) to 0 (Note [8-bit moments] in csrc/quant8.h).
EXTREME_GRADS = (1e19, 1e30, -1e30, FLT_MAX, -FLT_MAX, 1e-40)


def _extreme_grads(model) -> None:
    """Every 97th gradient element of each parameter an extreme value that its dtype holds
    (mixed blocks), and the first 256 of a.weight 1e30 (a block of nothing but overflow)."""
    with torch.no_grad():
        for p in model.parameters():
            g = p.grad
            values = torch.tensor(EXTREME_GRADS).to(g.dtype)
            values = values[torch.isfinite(values)]  # FLT_MAX is no BF16 value: it rounds to inf
            index = torch.arange(0, g.numel(), 97)
            g[torch.unravel_index(index, g.shape)] = values[index % len(values)]
        model.a.weight.grad.view(-1)[:256] = 1e30


OVERFLOW_OPTIONS = {
    "plain": {},
    "amsgrad": {"amsgrad": True},
    "stats": {"hierarchical_stats": True},
    "flat-stats-clip": {"flat_grads": True, "hierarchical_stats": True, "max_grad_norm": 0.05},
    "clip": {"max_grad_norm": 0.05},
}


@pytest.mark.parametrize("options", list(OVERFLOW_OPTIONS), ids=str)
def test_overflowing_moments_keep_the_parameters_finite(options):
    """Finite gradients of 1e19, 1e30, FLT_MAX and subnormals, alone and mixed in a block,
    with and without statistics and clipping: each 8-bit step is still the FP32 step on the
    decoded moments, and no parameter becomes NaN or infinite, as none does in the FP32
    step (an infinite second moment stays in its element: that parameter moves by its
    weight decay, the other 255 of the block as usual) nor in torch's AdamW (with
    clip_grad_norm_ where the option clips)."""
    kw = OVERFLOW_OPTIONS[options]
    model, ref = _Net(), _Net()
    opt = _make(model, min_8bit_size=256, **kw)
    torch_kw = {k: v for k, v in kw.items() if k == "amsgrad"}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, **torch_kw)
    for s in range(3):
        edit = _extreme_grads if s == 0 else None
        _oracle_step(model, opt, s, edit_grads=edit, min_8bit_size=256, **kw)
        copy_grads(model, ref)  # the gradients the step took (a step writes none)
        if "max_grad_norm" in kw:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), kw["max_grad_norm"])
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.isfinite(q).all()  # the premise: torch keeps them finite
            assert torch.isfinite(p).all(), f"a parameter became non-finite at step {s}"
    if "max_grad_norm" not in kw:  # unclipped, 1e30 squared is an infinite moment
        v = ruda_torch.dequantize_state_dict(opt.state_dict())["state"][0]["exp_avg_sq"]
        assert torch.isinf(v).any() and not torch.isnan(v).any()


@pytest.mark.parametrize(
    "precision",
    [("fp32", None), ("bf16", "nearest"), ("bf16", "stochastic"), ("8bit", None)],
    ids=["fp32", "bf16-nearest", "bf16-stochastic", "8bit"],
)
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["p32", "p16"])
def test_overflowing_moments_in_every_state_precision(precision, param_dtype):
    """The same gradients in every state precision, with 16-bit parameters too: every
    parameter stays finite, as in torch's AdamW."""
    state_precision, rounding = precision
    kw = {"state_precision": state_precision, "min_8bit_size": 256, "amsgrad": True}
    if rounding is not None:
        kw["state_rounding"] = rounding
    model = _Net(param_dtype)
    opt = _make(model, **kw)
    for s in range(3):
        opt.zero_grad()
        _backward(model, s)
        if s == 0:
            _extreme_grads(model)
        opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters()), f"step {s}"


def test_adam_l2_decay_with_8bit_moments():
    model = _Net()
    kw = dict(weight_decay=0.1, amsgrad=True)
    opt = ruda_torch.Adam(model.parameters(), lr=1e-2, fused_step=True, state_precision="8bit",
                          **kw)  # fmt: skip
    for s in range(3):
        _oracle_step(model, opt, s, cls=ruda_torch.Adam, **kw)


@pytest.mark.parametrize(
    "kw",
    [{"master_weights": True}, {"stochastic_rounding": True, "rounding_seed": 3}, {}],
    ids=["master", "stochastic", "nearest"],
)
def test_bf16_parameters_with_8bit_moments(kw):
    # Stochastic rounding draws an element's bits from its state offset: with rows of
    # whole blocks, the FP32 twin's slots start where ours do (and with contiguous
    # parameters, which 8-bit moments step in row-major order, the FP32 step in memory order).
    model = (
        _Net(torch.bfloat16, hidden=256, cols=256, inputs=256, transposed=False)
        if kw.get("stochastic_rounding")
        else _Net(torch.bfloat16)
    )
    opt = _make(model, **kw)
    for s in range(3):
        _oracle_step(model, opt, s, **kw)


def test_the_oracle_twin_steps_from_the_models_gradients(monkeypatch):
    """A machine whose matmuls round a twin's backward otherwise (AMD Zen 3: BF16 a.weight
    6e-5 apart through the other layout of t), played here by a forward that differs for a
    twin with a contiguous t: the oracle still holds, since the twin takes copies of the
    model's gradients (Note [Twins share gradients] in tests/optim_harness.py) and runs no
    backward of its own."""
    forward = _Net.forward

    def other_rounding(self, x):
        loss = forward(self, x)
        return loss if not self.t.is_contiguous() else loss * (1 + 2**-10)

    monkeypatch.setattr(_Net, "forward", other_rounding)
    model = _Net(torch.bfloat16)
    opt = _make(model, master_weights=True)
    for s in range(2):
        _oracle_step(model, opt, s, master_weights=True)


def test_min_8bit_size_decides_per_parameter():
    model = _Net()
    opt = _make(model, min_8bit_size=6000)
    _train(model, opt, 1)
    assert codes_key("exp_avg") in opt.state[model.a.weight]  # 9,900
    assert codes_key("exp_avg") in opt.state[model.b.weight]  # 6,000: at the threshold
    assert "exp_avg" in opt.state[model.t]  # 5,600: below
    for s in range(1, 3):
        _oracle_step(model, opt, s, min_8bit_size=6000)
    opt.param_groups[0]["min_8bit_size"] = 0  # every parameter, converted at the next step
    _train(model, opt, 1, start=3)
    assert all(codes_key("exp_avg") in opt.state[p] for p in model.parameters())
    with pytest.raises(ValueError, match="min_8bit_size must be a non-negative int"):
        _make(_Net(), min_8bit_size=-1)


def test_state_bytes_per_element():
    """Both moments in 2 + 8/256 bytes per element (the issue's bound: 2.1), 3.05 with
    AMSGrad, for rows of whole blocks; the small parameters' FP32 moments are a sliver."""
    model = _Net(hidden=256, cols=256, inputs=256)
    for amsgrad, bound in ((False, 2.1), (True, 3.1)):
        opt = _make(model, amsgrad=amsgrad)
        _train(model, opt, 1)
        big = [p for p in model.parameters() if p.numel() >= 4096]
        nbytes = sum(v.numel() * v.element_size() for p in big for k, v in opt.state[p].items()
                     if k in EIGHT_BIT_KEYS)  # fmt: skip
        assert nbytes / sum(p.numel() for p in big) <= bound


def test_training_stays_close_to_fp32_moments():
    model, ref = _Net(), _Net()
    opt, ropt = _make(model), _make(ref, state_precision="fp32")
    _train(model, opt, 30)
    _train(ref, ropt, 30)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        # 30 steps at lr 1e-2: the moments' 3% relative codes stay within a step's size.
        assert (p - q).abs().max().item() < 1e-2


# ------------------------------------------------------------------------ checkpoints


def test_checkpoint_resumes_bit_for_bit_through_torch_save():
    model, twin = _Net(), _Net()
    opt = _make(model, amsgrad=True)
    _train(model, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf)  # weights_only=True: plain tensors
    entry = ck["opt"]["state"][0]
    assert sorted(entry) == sorted(["step", *EIGHT_BIT_KEYS])
    assert entry["exp_avg_codes"].dtype == torch.uint8
    assert entry["exp_avg_scales"].dtype == torch.float32
    twin.load_state_dict(ck["model"])
    topt = _make(twin, amsgrad=True)
    topt.load_state_dict(ck["opt"])
    _train(model, opt, 3, start=3, twin=(twin, topt))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert same_bits(p.detach(), q.detach())
        assert opt.state[p].keys() == topt.state[q].keys()
        for k, v in opt.state[p].items():
            assert same_bits(v, topt.state[q][k]), k


def test_torch_checkpoint_loads_quantized_and_ours_converts_back():
    model, tm = _Net(), _Net()
    topt = torch.optim.AdamW(tm.parameters(), lr=1e-2, amsgrad=True)
    _train(tm, topt, 3)
    opt = _make(model, amsgrad=True)
    model.load_state_dict(tm.state_dict())
    opt.load_state_dict(topt.state_dict())
    for p, q in zip(model.parameters(), tm.parameters(), strict=True):
        st = opt.state[p]
        for key in MOMENTS:
            if p.numel() < 4096:
                assert same_bits(st[key], topt.state[q][key])
                continue
            codes, scales = _quantized(topt.state[q][key], key)
            assert same_bits(st[codes_key(key)], codes)
            assert same_bits(st[scales_key(key)], scales)
            assert key not in st
    # Ours into torch: converted by dequantize_state_dict (the input is left as it was).
    sd = opt.state_dict()
    converted = ruda_torch.dequantize_state_dict(sd)
    assert codes_key("exp_avg") in sd["state"][0]
    back = torch.optim.AdamW(_Net().parameters(), lr=1e-2, amsgrad=True)
    back.load_state_dict(converted)
    for (_, st), p in zip(back.state.items(), model.parameters(), strict=True):
        for key in MOMENTS:
            assert st[key].dtype == torch.float32 and st[key].shape == p.shape
            if p.numel() >= 4096:
                ours = opt.state[p]
                code = "signed" if key == "exp_avg" else "unsigned"
                want = ops.dequantize_8bit(ours[codes_key(key)], ours[scales_key(key)], code)
                assert same_bits(st[key], want)
    # Unconverted, torch's step stops on the missing moment rather than stepping wrongly.
    raw = torch.optim.AdamW(_Net().parameters(), lr=1e-2, amsgrad=True)
    raw.load_state_dict(sd)
    for p in raw.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    with pytest.raises(KeyError, match="exp_avg"):
        raw.step()


def test_changing_state_precision_converts_the_state():
    model = _Net()
    opt = _make(model, state_precision="fp32")
    _train(model, opt, 2)
    fp32 = {p: opt.state[p]["exp_avg"].clone() for p in model.parameters()}
    opt.param_groups[0]["state_precision"] = "8bit"
    _train(model, opt, 0)
    opt._current_plan()
    w = model.a.weight
    codes, scales = _quantized(fp32[w], "exp_avg")
    assert same_bits(opt.state[w]["exp_avg_codes"], codes)
    assert same_bits(opt.state[w]["exp_avg_scales"], scales)
    _oracle_step(model, opt, 2)
    for precision, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        opt.param_groups[0]["state_precision"] = precision
        _train(model, opt, 1, start=3)
        st = opt.state[w]
        assert st["exp_avg"].dtype == dtype and not any(k in st for k in EIGHT_BIT_KEYS)


def test_skipped_step_leaves_the_8bit_state_untouched():
    model = _Net()
    opt = _make(model, hierarchical_stats=True, max_grad_norm=1.0, amsgrad=True)
    _train(model, opt, 2)
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    params = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    _backward(model, 9)
    model.t.grad[3, 5] = float("nan")
    opt.step()
    assert opt.last_report.skipped.item()
    for p, q in zip(model.parameters(), params, strict=True):
        assert same_bits(p.detach(), q)
        for k, v in before[p].items():
            assert same_bits(opt.state[p][k], v), k


@pytest.mark.parametrize("scaler_kind", ["ruda", "torch"])
def test_grad_scaler_steps_match_unscaled_steps(scaler_kind):
    a, b = _Net(), _Net()
    oa, ob = _make(a, hierarchical_stats=scaler_kind == "ruda"), _make(b)
    make = ruda_torch.amp.GradScaler if scaler_kind == "ruda" else torch.amp.GradScaler
    scaler = make("cpu", init_scale=1024.0)
    _train(a, oa, 4, twin=(b, ob), scaler=scaler)
    assert scaler.get_scale() == 1024.0  # no step was skipped
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert same_bits(p.detach(), q.detach())


def test_compiled_step_gives_eager_bits():
    torch._dynamo.reset()
    a, b = _Net(), _Net()
    oa, ob = _make(a), _make(b)
    compiled = torch.compile(oa.step)
    for s in range(3):
        oa.zero_grad()
        _backward(a, s)
        copy_grads(a, b)
        compiled()
        ob.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert same_bits(p.detach(), q.detach())
        for k, v in oa.state[p].items():
            assert same_bits(v, ob.state[q][k]), k


# ------------------------------------------------------------------ coherence and errors


def test_a_users_state_is_honoured_in_either_form():
    model = _Net()
    opt = _make(model)
    _train(model, opt, 2)
    w = model.a.weight
    # An FP32 moment in place of the pair: quantized into the slot at the next step.
    values = torch.randn_like(w) * 1e-3
    st = opt.state[w]
    del st["exp_avg_codes"], st["exp_avg_scales"]
    st["exp_avg"] = values
    opt._current_plan()
    codes, scales = _quantized(values, "exp_avg")
    assert "exp_avg" not in opt.state[w]
    assert same_bits(opt.state[w]["exp_avg_codes"], codes)
    # A pair replaced by another pair (another parameter's): copied exactly.
    other = opt.state[model.b.weight]
    src = {k: opt.state[w][k].clone() for k in ("exp_avg_sq_codes", "exp_avg_sq_scales")}
    opt.state[w]["exp_avg_sq_codes"] = src["exp_avg_sq_codes"]
    opt.state[w]["exp_avg_sq_scales"] = src["exp_avg_sq_scales"]
    _oracle_step(model, opt, 2)
    assert other is opt.state[model.b.weight]
    # A fresh start.
    opt.state[w] = {}
    _oracle_step(model, opt, 3)
    assert opt.state[w]["step"].item() == 1


def test_added_parameters_get_8bit_state():
    model = _Net()
    opt = ruda_torch.AdamW([model.a.weight, model.a.bias], lr=1e-2, fused_step=True,
                           state_precision="8bit")  # fmt: skip
    _train(model, opt, 1)
    opt.add_param_group({"params": [model.b.weight, model.b.bias, model.t]})
    _train(model, opt, 1, start=1)
    assert opt.param_groups[1]["state_precision"] == "8bit"
    assert codes_key("exp_avg") in opt.state[model.t]


def _entry_error(mutate, match):
    model = _Net()
    opt = _make(model)
    _train(model, opt, 1)
    sd = opt.state_dict()
    entry = dict(sd["state"][0])
    mutate(entry)
    sd = {**sd, "state": {**sd["state"], 0: entry}}
    p = opt.param_groups[0]["params"][0]  # model.t, (80, 70): a block per row
    before = {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    for k, v in before.items():  # a rejected load changes nothing
        assert same_bits(opt.state[p][k], v)


@pytest.mark.parametrize(
    "case",
    ["half-pair", "both-forms", "codes-dtype", "codes-shape", "scales-dtype", "scales-count",
     "scales-shape", "missing-moment"],
)  # fmt: skip
def test_bad_8bit_entries_are_refused_before_anything_changes(case):
    def mutate(e):
        if case == "half-pair":
            del e["exp_avg_scales"]
        elif case == "both-forms":
            e["exp_avg"] = torch.zeros(e["exp_avg_codes"].shape)
        elif case == "codes-dtype":
            e["exp_avg_codes"] = e["exp_avg_codes"].to(torch.int8)
        elif case == "codes-shape":
            e["exp_avg_codes"] = e["exp_avg_codes"].reshape(-1)
        elif case == "scales-dtype":
            e["exp_avg_scales"] = e["exp_avg_scales"].double()
        elif case == "scales-count":
            e["exp_avg_scales"] = e["exp_avg_scales"][:-1]
        elif case == "scales-shape":
            e["exp_avg_scales"] = e["exp_avg_scales"].reshape(1, -1)
        else:
            del e["exp_avg_sq_codes"], e["exp_avg_sq_scales"]

    match = {
        "half-pair": "without 'exp_avg_scales'",
        "both-forms": "holds both 'exp_avg' and its 8-bit form",
        "codes-dtype": "must be uint8",
        "codes-shape": "has shape",
        "scales-dtype": "must be float32",
        "scales-count": r"has shape \(79, 1\); .* have shape \(80, 1\) or \(22,\)",
        "scales-shape": r"has shape \(1, 80\); .* have shape \(80, 1\)",
        "missing-moment": r"lacks \['exp_avg_sq'\]",
    }[case]
    _entry_error(mutate, match)


def test_8bit_entries_need_the_fused_path():
    model = _Net()
    opt = _make(model)
    _train(model, opt, 1)
    generic = ruda_torch.AdamW(_Net().parameters(), lr=1e-2)
    sd = opt.state_dict()
    sd["param_groups"][0].update(fused_step=False, state_precision="fp32")
    with pytest.raises(ValueError, match="8-bit moments .* only the fused path reads"):
        generic.load_state_dict(sd)
    generic.load_state_dict(ruda_torch.dequantize_state_dict(sd))
    assert not generic.param_groups[0]["fused_step"]
    with pytest.raises(ValueError, match="is for float32, float16 and bfloat16"):
        ruda_torch.AdamW([nn.Parameter(torch.randn(8, dtype=torch.float64))], fused_step=True,
                         state_precision="8bit")  # fmt: skip
    with pytest.raises(ValueError, match="state_precision must be one of"):
        ruda_torch.AdamW(_Net().parameters(), fused_step=True, state_precision="int8")
    with pytest.raises(ValueError, match="dequantize_state_dict takes an optimizer state dict"):
        ruda_torch.dequantize_state_dict([1])


def test_a_parameter_with_gaps_steps_as_its_contiguous_copy():
    """A non-dense parameter (``w[:, ::2]``) is stepped through a staging copy, its slot in
    row-major order: its codes and scales are those of a contiguous twin, bit for bit."""
    base = torch.randn(100, 200, generator=torch.Generator().manual_seed(1))
    gapped = nn.Parameter(base.clone()[:, ::2])
    plain = nn.Parameter(base.clone()[:, ::2].contiguous())
    assert not gapped.is_contiguous()
    opts = [ruda_torch.AdamW([p], fused_step=True, state_precision="8bit", amsgrad=True)
            for p in (gapped, plain)]  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        g = torch.randn(100, 100, generator=gen)
        gapped.grad, plain.grad = g.clone(), g.clone()
        for opt in opts:
            opt.step()
    assert same_bits(gapped.detach(), plain.detach())
    assert opts[0].state[gapped].keys() == opts[1].state[plain].keys()
    for k, v in opts[0].state[gapped].items():
        assert same_bits(v, opts[1].state[plain][k]), k


def _earlier_format(values: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What an earlier release's entry held for FP32 moment ``values`` (dense): codes laid
    out as the values, and 1-D scales of blocks of 256 codes in memory order."""
    code = "signed" if key == "exp_avg" else "unsigned"
    flat = values.as_strided((values.numel(),), (1,)).contiguous()  # memory order
    codes, scales = ops.quantize_8bit(flat, code)
    return codes.as_strided(values.shape, values.stride()), scales


def test_an_earlier_releases_checkpoint_loads():
    """Entries of the earlier format (scales of blocks of 256 in the codes' memory order,
    Note [8-bit state entries] in ruda_torch/_state8bit.py): where those blocks are the
    rows' (rows of whole blocks, one row) their codes and scales load as they are, bit for
    bit; elsewhere (rows of 33 and 300, a transposed parameter) they are decoded as the
    earlier release did and coded again by the rows; then the steps go on as from those
    moments."""
    model = _Net()
    whole = nn.Linear(256, 20)  # rows of 256: the earlier blocks are the rows'
    params = [*model.parameters(), whole.weight]
    opt = ruda_torch.AdamW(params, lr=1e-2, fused_step=True, state_precision="8bit",
                           min_8bit_size=4096, amsgrad=True)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    earlier, values = {}, {}
    for i, p in enumerate(params):
        entry = {"step": torch.tensor(5.0)}
        for key in MOMENTS:
            x = (torch.randn(p.shape, generator=gen) * 1e-3).as_strided(p.shape, p.stride())
            x = x.abs() if key != "exp_avg" else x
            if p.numel() < 4096:
                entry[key] = x
                continue
            codes, scales = _earlier_format(x, key)
            entry[codes_key(key)], entry[scales_key(key)] = codes, scales
            code = "signed" if key == "exp_avg" else "unsigned"
            flat = ops.dequantize_8bit(codes.as_strided((codes.numel(),), (1,)), scales, code)
            values[i, key] = flat.as_strided(p.shape, p.stride())  # what it decoded to
        earlier[i] = entry
    sd = opt.state_dict()
    opt.load_state_dict({"state": earlier, "param_groups": sd["param_groups"]})
    for i, p in enumerate(params):
        if p.numel() < 4096:
            continue
        st = opt.state[p]
        for key in MOMENTS:
            want_codes, want_scales = _quantized(values[i, key], key)
            assert same_bits(st[codes_key(key)], want_codes), (i, key)
            assert same_bits(st[scales_key(key)], want_scales), (i, key)
            if p is whole.weight:  # loaded as it was
                assert same_bits(st[codes_key(key)], earlier[i][codes_key(key)])
                assert same_bits(st[scales_key(key)].flatten(), earlier[i][scales_key(key)])
    # And it trains on: the steps are the FP32 steps on these moments.
    for s in range(2):
        opt.zero_grad()
        _backward(model, s)
        whole.weight.grad = torch.randn(whole.weight.shape, generator=gen)
        opt.step()
    assert all(torch.isfinite(p).all() for p in params)
    assert opt.state[whole.weight]["step"].item() == 7
