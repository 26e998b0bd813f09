"""Exact checks, never proxies (Note [Exact views] in csrc/py_records.h): whatever legal
sequence of calls changes a flat gradient view or a state view, the next step sees it,
side by side with torch.optim.AdamW doing the same calls.

Each case once stepped a stale or wrongly shaped gradient, or ignored a replaced state
tensor, because the check stood in for the fact: a buffer's sharing count for "did this
view move" (defeated by any other tensor that keeps a reference to the buffer), and
identity + address for "is this still the gradient of that shape" (defeated by in-place
metadata changes such as ``t_()`` or ``resize_``).
"""

from __future__ import annotations

import pytest
import torch
from optim_harness import copy_grads
from torch import nn

import ruda_torch

HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
STEPS = 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5))


def _make(kind: str, model):
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), **HP, foreach=False)
    return ruda_torch.AdamW(model.parameters(), **HP, fused_step=True, flat_grads=kind == "flat")


def _run(kind: str, action, steps: int = STEPS):
    """Train; ``action(model, opt, step)`` runs between backward and step. Returns the
    parameters (and the optimizer), or the exception the step raised with the
    parameters as they were then."""
    model = _model()
    opt = _make(kind, model)
    keep = []
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        keep.append(action(model, opt, step))  # kept alive: the references defeat proxies
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt.step()
        except RuntimeError as e:
            if kind != "torch":  # ours is all or nothing; torch's decays before it raises
                after = [p.detach() for p in model.parameters()]
                assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
            opt.zero_grad()  # still works, and puts the views back
            return e, model, opt
    opt.zero_grad()
    return None, model, opt


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_as_torch(action, steps: int = STEPS) -> None:
    err_t, torch_model, _ = _run("torch", action, steps)
    assert err_t is None, err_t
    _, plain, _ = _run("plain", action, steps)
    err, flat, _ = _run("flat", action, steps)
    assert err is None, err
    # flat_grads=True promises the bits of flat_grads=False; both follow torch.
    assert torch.equal(_params(flat), _params(plain))
    torch.testing.assert_close(_params(flat), _params(torch_model), rtol=2e-6, atol=1e-7)


# ------------------------------------------------------------------ flat gradient views


def test_grad_data_replaced_while_another_tensor_keeps_the_buffer():
    def share(model, opt, step):  # one view takes another's memory: sharing count kept
        model[2].bias.grad.data = model[0].bias.grad.data

    _same_as_torch(share)


def test_grad_data_replaced_while_a_detached_view_is_kept():
    def replace(model, opt, step):
        kept = model[2].weight.grad.detach()  # keeps the buffer's count up
        model[0].weight.grad.data = torch.full_like(model[0].weight, 0.5)
        return kept

    _same_as_torch(replace)


def test_grad_transposed_in_place_is_stepped_transposed():
    def transpose(model, opt, step):
        model[0].weight.grad.t_()  # square: same memory, other strides

    _same_as_torch(transpose)


@pytest.mark.parametrize("change", ["resize_", "unsqueeze_"])
def test_grad_reshaped_in_place_is_refused_as_torch(change):
    def reshape(model, opt, step):
        g = model[0].weight.grad
        g.resize_(2) if change == "resize_" else g.unsqueeze_(0)

    err_t, _, _ = _run("torch", reshape)
    err, _, opt = _run("flat", reshape)
    assert err_t is not None and err is not None
    assert "must have the same shape as params" in str(err)
    # zero_grad put an exact view back: the next step is a normal one.
    p = opt.param_groups[0]["params"][0]
    assert p.grad.shape == p.shape and p.grad.is_contiguous()


def test_grad_data_of_another_dtype_does_not_break_zero_grad():
    def half(model, opt, step):
        model[0].weight.grad.data = model[0].weight.grad.data.half()

    err, model, opt = _run("flat", half)
    assert err is None  # a 16-bit gradient of an FP32 parameter, as with flat_grads=False
    _, plain, _ = _run("plain", half)
    assert torch.equal(_params(model), _params(plain))
    p = model[0].weight
    assert p.grad.dtype == p.dtype and p.grad.shape == p.shape  # the view is back


def test_grad_dtype_is_refused_with_flat_grads():
    model = _model()
    model[0].weight.grad_dtype = torch.bfloat16
    with pytest.raises(ValueError, match="grad_dtype.*flat_grads=False"):
        ruda_torch.AdamW(model.parameters(), fused_step=True, flat_grads=True)
    ruda_torch.AdamW(model.parameters(), fused_step=True)  # accepted without flat_grads


@pytest.mark.parametrize("then", ["step", "zero_grad"])
def test_grad_dtype_set_after_construction_is_refused_before_any_write(then):
    """torch lets a parameter whose gradient was cleared take a grad_dtype of its own after
    the optimizer installed its flat views: the next step (or zero_grad) would have to put a
    view of the parameter's dtype back, which torch refuses. Refused up front: nothing
    stepped, no gradient zeroed, in any bucket; set right, the optimizer steps."""
    gen = torch.Generator().manual_seed(0)
    first = torch.nn.Parameter(torch.randn(6, 5, generator=gen))
    second = torch.nn.Parameter(torch.randn(7, generator=gen).bfloat16())
    opt = ruda_torch.AdamW([{"params": [first]}, {"params": [second]}], fused_step=True,
                           flat_grads=True, lr=1e-2)  # fmt: skip
    second.grad = None
    second.grad_dtype = torch.float32  # allowed: it has no gradient now
    (first.sum() * 2 + second.float().pow(2).sum()).backward()
    assert second.grad.dtype == torch.float32
    before = [t.detach().clone() for t in (first, second, first.grad, second.grad)]
    with pytest.raises(ValueError, match=r"param group 1.*grad_dtype=torch\.float32.*flat_grads=False"
                       if then == "step" else r"grad_dtype=torch\.float32.*flat_grads=False"):  # fmt: skip
        getattr(opt, then)()
    after = [t.detach() for t in (first, second, first.grad, second.grad)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert not opt.state or all(not st for st in opt.state.values())
    second.grad_dtype = None  # any gradient dtype: the view can go back
    opt.step()
    assert not torch.equal(first.detach(), before[0]) and second.grad.dtype == torch.bfloat16


# ------------------------------------------------------------------ state views


def test_state_data_replaced_while_another_tensor_keeps_the_buffer():
    def replace(model, opt, step):
        if step != 1:
            return None
        ps = list(model.parameters())
        kept = opt.state[ps[1]]["exp_avg"].detach()  # shares the bucket buffer: the
        opt.state[ps[0]]["exp_avg"].data = torch.zeros_like(ps[0])  # count stays equal
        return kept

    err_t, torch_model, torch_opt = _run("torch", replace)
    for kind in ("plain", "flat"):
        err, model, opt = _run(kind, replace)
        assert err is None
        torch.testing.assert_close(_params(model), _params(torch_model), rtol=2e-6, atol=1e-7)
        for p, q in zip(model.parameters(), torch_model.parameters(), strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(opt.state[p][key], torch_opt.state[q][key],
                                           rtol=2e-6, atol=1e-9)  # fmt: skip


def test_state_view_reshaped_in_place_is_noticed():
    """``t_()`` of a square moment keeps memory and count: only the strides tell."""

    def transpose(model, opt, step):
        if step == 1:
            opt.state[model[0].weight]["exp_avg"].t_()

    _same_as_torch(transpose)


# ------------------------------------------------------------------ load hooks


def _trained(kind: str, fused: bool = True):
    model = _model()
    opt = (torch.optim.AdamW(model.parameters(), **HP, foreach=False) if kind == "torch"
           else ruda_torch.AdamW(model.parameters(), **HP, fused_step=fused))  # fmt: skip
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(4, 5, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
    return model, opt


def _continue(model, opt) -> torch.Tensor:
    opt.zero_grad()
    model(torch.randn(4, 5, generator=torch.Generator().manual_seed(9))).sum().backward()
    opt.step()
    return _params(model)


@pytest.mark.parametrize("fused", [False, True], ids=["generic", "fused"])
def test_load_state_dict_pre_hook_result_is_what_loads(fused):
    def halve(optimizer, state_dict):
        new = {"param_groups": state_dict["param_groups"], "state": {}}
        for k, st in state_dict["state"].items():
            new["state"][k] = {**st, "exp_avg": st["exp_avg"] * 0.5, "step": st["step"] + 3}
        return new

    results = []
    for kind in ("torch", "ours"):
        model, opt = _trained(kind, fused)
        saved = opt.state_dict()
        opt.register_load_state_dict_pre_hook(halve)
        opt.load_state_dict(saved)
        p = next(iter(model.parameters()))
        assert float(opt.state[p]["step"]) == 5.0
        results.append(_continue(model, opt))
    torch.testing.assert_close(results[1], results[0], rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True], ids=["generic", "fused"])
def test_load_state_dict_pre_hook_may_drop_a_parameter(fused):
    """A checkpoint with one parameter more than the optimizer: a pre-hook drops it."""

    def drop_last(optimizer, state_dict):
        group = dict(state_dict["param_groups"][0])
        last = group["params"][-1]
        group["params"] = group["params"][:-1]
        state = {k: v for k, v in state_dict["state"].items() if k != last}
        return {"param_groups": [group], "state": state}

    results = []
    for kind in ("torch", "ours"):
        model, opt = _trained(kind, fused)
        saved = opt.state_dict()
        smaller = list(model.parameters())[:-1]
        opt2 = (torch.optim.AdamW(smaller, **HP, foreach=False) if kind == "torch"
                else ruda_torch.AdamW(smaller, **HP, fused_step=fused))  # fmt: skip
        opt2.register_load_state_dict_pre_hook(drop_last)
        opt2.load_state_dict(saved)
        results.append(_continue(model, opt2))
    torch.testing.assert_close(results[1], results[0], rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True], ids=["generic", "fused"])
def test_load_state_dict_post_hook_replacing_state_is_used(fused):
    def reset_first(optimizer):
        p = optimizer.param_groups[0]["params"][0]
        optimizer.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.full_like(p, 0.01),
            "exp_avg_sq": torch.full_like(p, 1e-4),
        }

    results = []
    for kind in ("torch", "ours"):
        model, opt = _trained(kind, fused)
        saved = opt.state_dict()
        opt.register_load_state_dict_post_hook(reset_first)
        opt.load_state_dict(saved)
        results.append(_continue(model, opt))
    torch.testing.assert_close(results[1], results[0], rtol=2e-6, atol=1e-7)


# ------------------------------------------------------------------ options before every step


def _bf16_or_fp16(dtype, **kwargs):
    torch.manual_seed(3)
    p = nn.Parameter(torch.randn(97).to(dtype))
    opt = ruda_torch.AdamW([p], **HP, fused_step=True, **kwargs)
    p.grad = torch.randn(97).to(dtype)
    return p, opt


def test_group_options_are_validated_before_every_step():
    p, opt = _bf16_or_fp16(torch.float16)
    opt.param_groups[0]["stochastic_rounding"] = True  # refused at construction too
    before = p.detach().clone()
    with pytest.raises(ValueError, match="stochastic_rounding=True is implemented for bfloat16"):
        opt.step()
    assert torch.equal(p, before) and not opt.state
    generic = ruda_torch.AdamW([nn.Parameter(torch.randn(3))])
    generic.param_groups[0]["master_weights"] = True
    generic.param_groups[0]["params"][0].grad = torch.randn(3)
    with pytest.raises(ValueError, match="require fused_step=True"):
        generic.step()
    assert not generic.state
    p, opt = _bf16_or_fp16(torch.bfloat16)
    opt.param_groups[0]["rounding_seed"] = "7"
    with pytest.raises(ValueError, match="rounding_seed must be an int .* got str '7'"):
        opt.step()


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70])
def test_rounding_seed_out_of_64_bits_is_refused(seed):
    with pytest.raises(ValueError, match="rounding_seed must be a 64-bit value"):
        ruda_torch.AdamW([nn.Parameter(torch.randn(3))], fused_step=True, rounding_seed=seed)


def test_an_accepted_option_change_takes_effect():
    """stochastic_rounding switched on after construction steps as if built with it."""
    p, opt = _bf16_or_fp16(torch.bfloat16)
    opt.param_groups[0]["stochastic_rounding"] = True
    opt.param_groups[0]["rounding_seed"] = 2**64 - 1
    opt.step()
    q, ref = _bf16_or_fp16(torch.bfloat16, stochastic_rounding=True, rounding_seed=2**64 - 1)
    ref.step()
    assert torch.equal(p.view(torch.int16), q.view(torch.int16))
    r, nearest = _bf16_or_fp16(torch.bfloat16)
    nearest.step()
    assert not torch.equal(p.view(torch.int16), r.view(torch.int16))


# ------------------------------------------------------------------ atomic steps


def test_meta_tensor_lr_is_refused_before_any_write():
    p = nn.Parameter(torch.randn(5))
    opt = ruda_torch.AdamW([p])
    opt.param_groups[0]["lr"] = torch.tensor(1e-3, device="meta")
    p.grad = torch.randn(5)
    with pytest.raises(ValueError, match="meta device"):
        opt.step()
    assert not opt.state  # no counter advanced, no state created


def test_float64_parameter_under_statistics_is_refused_before_buckets_change():
    model = _model()
    opt = ruda_torch.AdamW(model.parameters(), fused_step=True, hierarchical_stats=True)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    plan = opt._plan
    state = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    model[0].weight.data = model[0].weight.data.double()
    model[0].weight.grad = torch.randn_like(model[0].weight)
    with pytest.raises(ValueError, match="parameter 0 is float64"):
        opt.step()
    assert opt._plan is plan  # the buckets were not rebuilt
    for k, v in state.items():
        assert torch.equal(opt.state[model[0].weight][k], v)


# ------------------------------------------------------------------ smaller ones


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_tensor_lr_is_refused(dtype):
    with pytest.raises(ValueError, match="Tensor lr must be float32 or float64"):
        ruda_torch.AdamW([nn.Parameter(torch.randn(3))], lr=torch.tensor(1e-3, dtype=dtype))


@pytest.mark.parametrize("fused", [False, True], ids=["generic", "fused"])
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0-d", "1-d", "2-d"])
def test_tensor_lr_of_any_one_element_shape(fused, shape):
    """torch's test_tensor_lr: a 2-d lr tensor failed on the generic path."""
    results = []
    for lr in (1e-3, torch.tensor(1e-3).reshape(shape)):
        torch.manual_seed(0)
        w, b = nn.Parameter(torch.randn(10, 5)), nn.Parameter(torch.randn(10))  # as torch's
        opt = ruda_torch.AdamW([w, b], lr=lr, fused_step=fused)
        for _ in range(2):
            w.grad, b.grad = torch.randn(10, 5), torch.randn(10)
            opt.step()
        results.append(torch.cat([w.detach().reshape(-1), b.detach()]))
    assert torch.equal(results[0], results[1])


def test_grad_scaler_without_gradients_raises_as_torch():
    """torch's scaler raises when its pass saw no gradient; ours must not grow the scale."""
    cases = [
        (torch.amp.GradScaler, lambda ps: torch.optim.AdamW(ps)),  # the reference
        (ruda_torch.amp.GradScaler,
         lambda ps: ruda_torch.AdamW(ps, fused_step=True, hierarchical_stats=True)),
    ]  # fmt: skip
    for scaler_cls, make in cases:
        scaler = scaler_cls("cpu", init_scale=2.0**8, growth_interval=1)
        p = nn.Parameter(torch.randn(3))
        opt = make([p])
        scaler.scale(p.sum())  # the scale exists, but no backward gave a gradient
        with pytest.raises(AssertionError, match="No inf checks were recorded"):
            scaler.step(opt)
        assert scaler.get_scale() == 2.0**8


@pytest.mark.parametrize(
    "options",
    [{"fused_step": False}, {"fused_step": True}, {"fused_step": True, "maximize": True},
     {"fused_step": True, "flat_grads": True, "amsgrad": True}],
    ids=["generic", "fused", "fused-maximize", "fused-flat-amsgrad"],
)  # fmt: skip
def test_float64_clip_coefficient_is_float64(options):
    """max_grad_norm on FP64 parameters (tensor-operation norm), on either path: the
    coefficient is FP64, as clip_grad_norm_'s, and the fused kernel reads it so (an FP32
    one was 3e-8 relative off): parameters and moments follow clip_grad_norm_ +
    torch.optim.AdamW in FP64 over five steps, to the last bits of the norm's summation
    order (clip_grad_norm_ takes the norm of the tensors' norms, we the root of their
    squares' sum)."""
    torch.manual_seed(5)
    shapes = [(1025,), (97,), (33, 7)]
    ps = [nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    twins = [nn.Parameter(p.detach().clone()) for p in ps]
    ours = ruda_torch.AdamW(ps, **HP, max_grad_norm=0.5, **options)
    torch_kw = {k: v for k, v in options.items() if k in ("maximize", "amsgrad")}
    theirs = torch.optim.AdamW(twins, **HP, foreach=False, **torch_kw)
    for _ in range(5):
        for p, q in zip(ps, twins, strict=True):
            g = torch.randn(p.shape, dtype=torch.float64) * 3
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)  # into the flat views where there are any
            q.grad = g.clone()
        ours.step()
        torch.nn.utils.clip_grad_norm_(twins, 0.5)
        theirs.step()
    for p, q in zip(ps, twins, strict=True):
        # exp_avg = (1 - beta1) * clip * g carries the coefficient's precision.
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[p][key], theirs.state[q][key], rtol=1e-13, atol=0)
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-14, atol=1e-15)


class _TaggedParameter(nn.Parameter):
    """A parameter subclass: the checks' worker threads leave it to the calling thread
    (Note [Checks on all threads] in csrc/py_checks.cpp)."""


@pytest.mark.parametrize("flat", [False, True], ids=["gathered", "flat"])
def test_checks_on_all_threads_see_every_change_among_many_parameters(flat):
    """More parameters than one thread's share of the checks (2,048), some of a Parameter
    subclass (without flat_grads): a state view replaced through ``.data``, a state view transposed in place
    and a subclass parameter's new layout, each far into the list, are all seen; the
    steps match torch.optim.AdamW doing the same."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        shapes = [(3, 3) if i % 5 == 0 else (7,) for i in range(5000)]
        values = [torch.randn(s) for s in shapes]
        # (flat_grads takes plain parameters only)
        tagged = nn.Parameter if flat else _TaggedParameter
        ours = [(tagged if i % 7 == 0 else nn.Parameter)(v.clone())
                for i, v in enumerate(values)]  # fmt: skip
        ref = [nn.Parameter(v.clone()) for v in values]
        opt = ruda_torch.AdamW(ours, **HP, fused_step=True, flat_grads=flat)
        topt = torch.optim.AdamW(ref, **HP, foreach=False)

        def step(k):
            for p, q in zip(ours, ref, strict=True):
                g = torch.randn(p.shape, generator=torch.Generator().manual_seed(k))
                if flat:
                    p.grad.copy_(g)
                else:
                    p.grad = g
                q.grad = g.clone()
            opt.step()
            topt.step()

        step(0)
        for i in (4001, 4995):  # replaced through .data, transposed in place (square)
            opt.state[ours[i]]["exp_avg"].data = torch.full_like(ours[i], 0.25)
            topt.state[ref[i]]["exp_avg"].data = torch.full_like(ref[i], 0.25)
        opt.state[ours[4995]]["exp_avg_sq"].t_()
        topt.state[ref[4995]]["exp_avg_sq"].t_()
        step(1)
        assert type(ours[4998]) is tagged and ours[4998].shape == (7,)
        with torch.no_grad():  # a subclass parameter's layout changes: the plan follows
            ours[4970].data = ours[4970].data.t().contiguous().t()
            ref[4970].data = ref[4970].data.t().contiguous().t()
        step(2)
        for p, q in zip(ours, ref, strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=2e-6, atol=1e-7)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("flat", [False, True], ids=["gathered", "flat"])
def test_state_values_are_tensors_of_their_own_as_torchs(flat):
    """The state values (and the flat gradients) are tensors of their own over the
    bucket's memory (Note [Tensors of their own] in csrc/py_records.h): no ``_base`` and the
    layout of torch's, at the first step and after a load; writes through them reach the
    next step as torch's do."""
    model = _model()
    ref = _model()
    opt = _make("flat" if flat else "ours", model)
    topt = _make("torch", ref)

    def step(k):
        opt.zero_grad()
        model(
            torch.randn(4, 5, generator=torch.Generator().manual_seed(k))
        ).square().sum().backward()
        copy_grads(model, ref)  # Note [Twins share gradients] in tests/optim_harness.py
        opt.step()
        topt.step()

    def same_kind():
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            ours, theirs = opt.state[p], topt.state[q]
            assert ours.keys() == theirs.keys()
            for key, value in ours.items():
                assert value._base is None and theirs[key]._base is None, key
                assert value.shape == theirs[key].shape and value.stride() == theirs[key].stride()
            if flat:
                assert p.grad._base is None

    step(0)
    same_kind()
    opt.load_state_dict(topt.state_dict())  # every slot adopted from the loaded entries
    step(1)
    same_kind()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        opt.state[p]["exp_avg"].mul_(0.5)
        topt.state[q]["exp_avg"].mul_(0.5)
    step(2)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["exp_avg"], topt.state[q]["exp_avg"])
