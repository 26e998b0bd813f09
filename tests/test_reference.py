"""The FP64 reference (ruda_torch/reference.py) and the committed fixture file.

These are the oracle tests: they need torch only, not the native extension. The
reference is checked against torch.optim.AdamW run in float64, so that the oracle the
kernel tests rely on is itself tied to torch's definition of AdamW.
"""

from __future__ import annotations

import math

import pytest
import torch
from fixture_walk import FIXTURE_PATH, FIXTURES, load_module, reference
from tolerances import TOLERANCES

adamw_reference = reference.adamw_reference
bias_correction = reference.bias_correction
global_norm_reference = reference.global_norm_reference

NUMEL = 97  # not a multiple of any SIMD width

# Non-default values that make every term of the update matter.
BASE = {
    "lr": 1e-2,
    "betas": (0.8, 0.95),
    "eps": 1e-6,
    "weight_decay": 0.1,
    "amsgrad": False,
    "maximize": False,
    "gradient_scale": 1.0,
    "clip_coef": 1.0,
}
# One row per optimizer configuration: (id, overrides of BASE, steps).
CONFIGS = [
    ("adamw", {}, 7),
    ("no_weight_decay", {"weight_decay": 0.0}, 7),
    ("amsgrad", {"amsgrad": True}, 7),
    ("maximize", {"maximize": True}, 7),
    ("amsgrad_maximize", {"amsgrad": True, "maximize": True}, 7),
    ("scaled_clipped", {"gradient_scale": 1024.0, "clip_coef": 0.37}, 7),
    ("amsgrad_scaled_clipped", {"amsgrad": True, "gradient_scale": 3.0, "clip_coef": 0.25}, 7),
    (
        "spec_defaults_long",
        {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-5, "weight_decay": 1e-4, "amsgrad": True},
        60,
    ),
]


def _random_gradient(generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """Gradient values from 1e-8 to 1e2 in magnitude, one exact zero."""
    shape = torch.randn(NUMEL, generator=generator, dtype=torch.float64)
    log10 = torch.empty(NUMEL, dtype=torch.float64).uniform_(-8.0, 2.0, generator=generator)
    grad = shape * torch.pow(10.0, log10)
    grad[int(torch.randint(NUMEL, (1,), generator=generator))] = 0.0
    return grad.to(dtype)


def _assert_fp64_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    rtol = TOLERANCES["reference_vs_torch_float64"].rtol
    expected = expected.detach()
    atol = rtol * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize(
    ("overrides", "steps"), [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS]
)
def test_reference_matches_torch_adamw_in_float64(overrides, steps):
    config = {**BASE, **overrides}
    generator = torch.Generator().manual_seed(1234)
    initial = torch.randn(NUMEL, generator=generator, dtype=torch.float64)
    param = torch.nn.Parameter(initial.clone())
    optimizer = torch.optim.AdamW(
        [param],
        lr=config["lr"],
        betas=config["betas"],
        eps=config["eps"],
        weight_decay=config["weight_decay"],
        amsgrad=config["amsgrad"],
        maximize=config["maximize"],
        foreach=False,
        fused=False,
    )
    # torch has no gradient scale or clip coefficient: it gets the gradient pre-scaled
    # with the same FP64 product the reference forms, while the reference gets the
    # stored gradient. The step enters as the 0-dim tensor the previous call returned.
    state = (initial, None, None, None, 0)
    for k in range(1, steps + 1):
        stored = _random_gradient(generator)
        param.grad = stored * (config["clip_coef"] / config["gradient_scale"])
        optimizer.step()
        p, m, v, v_max, step = adamw_reference(state[0], stored, *state[1:], **config)
        expected = optimizer.state[param]
        _assert_fp64_close(p, param, f"step {k} param")
        _assert_fp64_close(m, expected["exp_avg"], f"step {k} exp_avg")
        _assert_fp64_close(v, expected["exp_avg_sq"], f"step {k} exp_avg_sq")
        if config["amsgrad"]:
            _assert_fp64_close(v_max, expected["max_exp_avg_sq"], f"step {k} max_exp_avg_sq")
        else:
            assert v_max is None
        assert step.dtype == torch.float64 and step.dim() == 0
        assert step.item() == expected["step"].item() == k
        state = (p, m, v, v_max, step)


def test_first_step_closed_form():
    # At t = 1 from zero moments, m / (1 - beta1) = g and v / (1 - beta2) = g^2, so
    # p_new = p (1 - lr wd) - lr g / (|g| + eps): a value independent of torch.
    generator = torch.Generator().manual_seed(5)
    param = torch.randn(NUMEL, generator=generator, dtype=torch.float64)
    grad = _random_gradient(generator)
    p, *_ = adamw_reference(param, grad, None, None, None, 0, **BASE)
    lr, wd, eps = BASE["lr"], BASE["weight_decay"], BASE["eps"]
    expected = param * (1 - lr * wd) - lr * grad / (grad.abs() + eps)
    torch.testing.assert_close(p, expected, rtol=1e-14, atol=1e-16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gradient_converted_exactly(dtype):
    generator = torch.Generator().manual_seed(6)
    param = torch.randn(NUMEL, generator=generator, dtype=torch.float32)
    grad = _random_gradient(generator, dtype)
    exact = grad.to(torch.float64)
    a = adamw_reference(param, grad, None, None, None, 3, **{**BASE, "amsgrad": True})
    b = adamw_reference(param.double(), exact, None, None, None, 3, **{**BASE, "amsgrad": True})
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_reference_is_out_of_place():
    generator = torch.Generator().manual_seed(7)
    # param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq
    inputs = [torch.randn(4, 5, generator=generator, dtype=torch.float32) for _ in range(5)]
    inputs[3] = inputs[3].abs()
    inputs[4] = inputs[3] + 1.0
    saved = [t.clone() for t in inputs]
    step = torch.tensor(4.0)
    outputs = adamw_reference(*inputs, step, **{**BASE, "amsgrad": True})
    for before, after in zip(saved, inputs, strict=True):
        assert torch.equal(before, after)
    assert step.item() == 4.0
    for out in outputs:
        assert out.dtype == torch.float64 and out.device.type == "cpu"
        assert all(
            out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in inputs
        )
    assert outputs[0].shape == (4, 5)
    assert outputs[4].item() == 5.0


def test_fresh_state_is_zeros_and_step_forms_agree():
    generator = torch.Generator().manual_seed(8)
    param = torch.randn(NUMEL, generator=generator)
    grad = _random_gradient(generator, torch.float32)
    zeros = torch.zeros(NUMEL)
    options = {**BASE, "amsgrad": True}
    fresh = adamw_reference(param, grad, None, None, None, 0, **options)
    explicit = adamw_reference(param, grad, zeros, zeros, zeros, torch.tensor(0.0), **options)
    for x, y in zip(fresh, explicit, strict=True):
        assert torch.equal(x, y)
    later_int = adamw_reference(param, grad, zeros, zeros, zeros, 9, **options)
    later_tensor = adamw_reference(param, grad, zeros, zeros, zeros, torch.tensor(9.0), **options)
    for x, y in zip(later_int, later_tensor, strict=True):
        assert torch.equal(x, y)
    without = adamw_reference(param, grad, zeros, zeros, zeros, 0, **BASE)
    assert without[3] is None


def test_amsgrad_stores_the_uncorrected_maximum():
    param = torch.zeros(3, dtype=torch.float64)
    grad = torch.tensor([1.0, 0.0, -2.0], dtype=torch.float64)
    v_max_old = torch.tensor([0.5, 0.25, 0.0], dtype=torch.float64)
    v_old = torch.zeros(3, dtype=torch.float64)
    _, _, v, v_max, _ = adamw_reference(
        param, grad, None, v_old, v_max_old, 4, **{**BASE, "amsgrad": True}
    )
    assert torch.equal(v_max, torch.maximum(v_max_old, v))


def test_zero_size_tensors():
    empty = torch.empty(0, 3)
    p, m, v, v_max, step = adamw_reference(empty, empty, None, None, None, 0, **BASE)
    assert p.shape == m.shape == v.shape == (0, 3) and v_max is None and step.item() == 1


# (id, keyword overrides of a valid call, exception, message)
BAD_INPUTS = [
    ("grad_shape", {"grad": torch.zeros(5, 4)}, ValueError, "grad must have the same shape"),
    ("exp_avg_shape", {"exp_avg": torch.zeros(3)}, ValueError, "exp_avg must have the same shape"),
    ("integer_param", {"param": torch.zeros(4, 5, dtype=torch.int32)}, TypeError, "param must"),
    ("not_a_tensor", {"grad": [0.0] * 20}, TypeError, "grad must be a torch.Tensor"),
    ("negative_step", {"step": -1}, ValueError, "step must be non-negative"),
    ("fractional_step", {"step": torch.tensor(1.5)}, ValueError, "integer count"),
    ("float_step", {"step": 2.0}, TypeError, "step must be an int"),
    ("beta1", {"betas": (1.0, 0.9)}, ValueError, "Invalid beta parameter at index 0: 1.0"),
    ("beta2", {"betas": (0.9, -0.1)}, ValueError, "Invalid beta parameter at index 1: -0.1"),
    ("lr", {"lr": -1.0}, ValueError, "Invalid learning rate: -1.0"),
    ("eps", {"eps": -1e-8}, ValueError, "Invalid epsilon value"),
    ("weight_decay", {"weight_decay": -0.1}, ValueError, "Invalid weight_decay value"),
    (
        "zero_scale",
        {"gradient_scale": 0.0},
        ValueError,
        "gradient_scale must be finite and positive",
    ),
    ("inf_scale", {"gradient_scale": math.inf}, ValueError, "gradient_scale must be finite"),
    ("nan_clip", {"clip_coef": math.nan}, ValueError, "clip_coef must be finite"),
]


@pytest.mark.parametrize(
    ("overrides", "error", "message"), [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_reference_rejects_bad_input(overrides, error, message):
    call = {
        "param": torch.zeros(4, 5),
        "grad": torch.zeros(4, 5),
        "exp_avg": None,
        "exp_avg_sq": None,
        "max_exp_avg_sq": None,
        "step": 0,
        **BASE,
    }
    call.update(overrides)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        adamw_reference(**call)


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 0.9999])
def test_bias_correction_against_pow(beta):
    rtol = TOLERANCES["bias_correction_vs_pow"].rtol
    assert bias_correction(beta, 0) == 0.0
    assert bias_correction(beta, 1) == 1.0 - beta
    for t in [*range(2, 2049), 4097, 12345, 10**5, 10**6, 2**31 - 1, 2**40 + 7]:
        expected = 1.0 - beta**t
        assert math.isclose(bias_correction(beta, t), expected, rel_tol=rtol), (beta, t)


def test_bias_correction_rejects_bad_step():
    with pytest.raises(TypeError, match="t must be an int"):
        bias_correction(0.9, 2.0)
    with pytest.raises(ValueError, match="t must be non-negative"):
        bias_correction(0.9, -1)


def _fsum_statistics(
    tensors: list[torch.Tensor], gradient_scale: float
) -> tuple[float, float, int]:
    values = [x / gradient_scale for t in tensors for x in t.to(torch.float64).reshape(-1).tolist()]
    finite = [x for x in values if math.isfinite(x)]
    return (
        math.fsum(x * x for x in finite),
        max((abs(x) for x in finite), default=0.0),
        len(values) - len(finite),
    )


@pytest.mark.parametrize("gradient_scale", [1.0, 512.0, 3.0])
def test_global_norm_reference_with_nonfinite(gradient_scale):
    generator = torch.Generator().manual_seed(9)

    def grad(n, dtype):
        log10 = torch.empty(n, dtype=torch.float64).uniform_(-6.0, 3.0, generator=generator)
        return (torch.randn(n, generator=generator, dtype=torch.float64) * 10**log10).to(dtype)

    fp32 = grad(1000, torch.float32)
    fp32[3], fp32[17], fp32[999] = math.nan, math.inf, -math.inf
    fp16 = grad(500, torch.float16)  # squares above 65504 would overflow in FP16
    fp16[0] = -math.inf
    bf16 = grad(21, torch.bfloat16).reshape(3, 7)
    bf16[1, 2] = math.nan
    tensors = [fp32, fp16, bf16, torch.empty(0)]

    sum_sq, max_abs, nonfinite = global_norm_reference(tensors, gradient_scale)
    expected_sum, expected_max, expected_count = _fsum_statistics(tensors, gradient_scale)
    assert nonfinite == expected_count == 5
    assert max_abs == expected_max
    assert math.isclose(sum_sq, expected_sum, rel_tol=TOLERANCES["global_norm_vs_fsum"].rtol)
    assert global_norm_reference(fp32, gradient_scale) == global_norm_reference(
        [fp32], gradient_scale
    )


def test_global_norm_reference_edge_cases():
    assert global_norm_reference([]) == (0.0, 0.0, 0)
    assert global_norm_reference(torch.zeros(7)) == (0.0, 0.0, 0)
    assert global_norm_reference(torch.full((4,), math.nan)) == (0.0, 0.0, 4)
    assert global_norm_reference(torch.tensor([3.0, -4.0])) == (25.0, 4.0, 0)
    with pytest.raises(ValueError, match="gradient_scale must be finite and positive"):
        global_norm_reference(torch.zeros(2), 0.0)
    with pytest.raises(TypeError, match=r"grads\[1\] must be a floating-point tensor"):
        global_norm_reference([torch.zeros(2), torch.zeros(2, dtype=torch.int64)])


# --- the committed fixture file -------------------------------------------------------


def test_fixture_file_layout():
    assert FIXTURE_PATH.stat().st_size < 1_000_000
    assert set(FIXTURES["generator"]) >= {"script", "command", "torch_version", "cpu_capability"}
    cases = FIXTURES["cases"]
    assert len({case["name"] for case in cases}) == len(cases) == 12
    combos = {
        (c["grad_dtype"], c["hyperparameters"]["amsgrad"], c["hyperparameters"]["maximize"])
        for c in cases
    }
    assert combos == {
        (d, a, m)
        for d in ("float32", "float16", "bfloat16")
        for a in (False, True)
        for m in (False, True)
    }
    for case in cases:
        hyper = case["hyperparameters"]
        # Differ from both torch's defaults and docs/design.md section 1's, so no term is untested.
        assert hyper["lr"] != 1e-3 and hyper["eps"] not in (1e-8, 1e-5)
        assert hyper["weight_decay"] not in (0.0, 1e-2, 1e-4)
        assert tuple(hyper["betas"]) != (0.9, 0.999)
        dtype = getattr(torch, case["grad_dtype"])
        assert len(case["initial_param"]) == FIXTURES["numel"] == NUMEL
        assert [s["step"] for s in case["steps"]] == list(range(1, FIXTURES["steps_per_case"] + 1))
        assert FIXTURES["steps_per_case"] == 5
        for record in case["steps"]:
            grad = torch.tensor(record["grad"], dtype=torch.float64)
            assert torch.equal(grad.to(dtype).to(torch.float64), grad), "grad not in its dtype"
            assert ("max_exp_avg_sq" in record) == hyper["amsgrad"]
            for name in ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if name in record:
                    values = torch.tensor(record[name], dtype=torch.float64)
                    assert values.shape == (NUMEL,)
                    assert torch.equal(values.to(torch.float32).to(torch.float64), values), name


def test_fixture_file_is_up_to_date():
    generator = FIXTURES["generator"]
    recorded = (generator["torch_version"], generator["cpu_capability"])
    here = (torch.__version__, torch.backends.cpu.get_cpu_capability())
    if recorded != here:
        pytest.skip(
            f"fixtures were generated by torch {recorded[0]} ({recorded[1]} kernels), this is "
            f"torch {here[0]} ({here[1]} kernels): torch's CPU rounding may differ, so a "
            "regeneration here is not expected to match"
        )
    make_fixtures = load_module("tools/make_fixtures.py", "make_fixtures_tool")
    difference = make_fixtures.check()
    assert difference is None, (
        f"{difference}; regenerate with: python {generator['script']} --write"
    )
