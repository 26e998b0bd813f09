"""Shared by the fixture tests: the FP64 reference, the fixture file, and the walk that
checks an implementation step by step against both.

ruda_torch/reference.py and tools/make_fixtures.py are loaded from their files rather
than imported through the package: the oracle tests must run where the native
extension is not built (the package's __init__ loads it), and tools/ is not a package.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from tolerances import TOLERANCES

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURE_PATH = REPO_ROOT / "fixtures" / "pytorch_fixtures.json"
QUANTITIES = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def load_module(relative_path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / relative_path)
    assert spec is not None and spec.loader is not None, relative_path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = load_module("ruda_torch/reference.py", "ruda_torch_reference_file")

with open(FIXTURE_PATH, encoding="utf-8") as _f:
    FIXTURES: dict = json.load(_f)
CASES: list[dict] = FIXTURES["cases"]
CASE_IDS: list[str] = [case["name"] for case in CASES]

# step_fn(param_fp32, stored_grad, opaque_state, gradient_scale) returns
# (param, exp_avg, exp_avg_sq, max_exp_avg_sq or None, step, opaque_state), the new
# FP32 tensors and step count (a number or a 0-dim tensor); opaque_state is None at
# the first step and whatever step_fn returned afterwards.
StepFn = Callable[[torch.Tensor, torch.Tensor, object, float], tuple]


def grad_dtype(case: dict) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
        case["grad_dtype"]
    ]


def stored_gradient(case: dict, record: dict, gradient_scale: float) -> torch.Tensor:
    """The fixture gradient times `gradient_scale`, in the case's dtype; must be exact."""
    dtype = grad_dtype(case)
    grad = torch.tensor(record["grad"], dtype=dtype)
    stored = (grad.to(torch.float32) * gradient_scale).to(dtype)
    unscaled = stored.to(torch.float64) / gradient_scale
    assert torch.equal(unscaled, grad.to(torch.float64)), (
        f"gradient_scale {gradient_scale} does not scale {case['name']}'s gradient exactly"
    )
    return stored


def _fp32(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _reference_step(previous: list, grad: torch.Tensor, k: int, options: dict) -> list:
    param, exp_avg, exp_avg_sq, max_exp_avg_sq = previous
    out = reference.adamw_reference(
        param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, k - 1, **options
    )
    return list(out[:4])


def walk_case(case: dict, step_fn: StepFn, *, gradient_scale: float = 1.0) -> None:
    """Step `step_fn` through a fixture case; check every step against torch and FP64.

    Two checks per step and quantity (Note [Tolerance tied to torch's own error]):
    - one step: the FP64 reference applied to each implementation's OWN previous state
      measures the error of that step alone, for ours and for torch (whose previous
      state is the fixture's);
    - chain: the FP64 reference chained from the initial parameter measures the
      accumulated error of both.
    """
    hyper = case["hyperparameters"]
    amsgrad = hyper["amsgrad"]
    options = {
        "lr": hyper["lr"],
        "betas": tuple(hyper["betas"]),
        "eps": hyper["eps"],
        "weight_decay": hyper["weight_decay"],
        "amsgrad": amsgrad,
        "maximize": hyper["maximize"],
        "gradient_scale": gradient_scale,
    }
    names = QUANTITIES if amsgrad else QUANTITIES[:3]
    initial = _fp32(case["initial_param"])
    zeros = torch.zeros_like(initial)
    ours_prev = [initial, zeros, zeros, zeros if amsgrad else None]
    torch_prev = list(ours_prev)
    chain = [initial.to(torch.float64), None, None, None]
    state = None
    for record in case["steps"]:
        k = record["step"]
        grad = stored_gradient(case, record, gradient_scale)
        *ours, step, state = step_fn(ours_prev[0], grad, state, gradient_scale)
        assert float(step) == k, f"{case['name']} step {k}: step counter is {float(step)}"
        for name, value in zip(QUANTITIES, ours, strict=True):
            if name not in names:
                assert value is None, f"{case['name']}: {name} without AMSGrad"
            else:
                assert value.dtype == torch.float32, f"{name} is {value.dtype}, not float32"
                assert value.shape == initial.shape, f"{name} has shape {list(value.shape)}"
        expected = [_fp32(record[name]) for name in names]

        ref_ours = _reference_step(ours_prev, grad, k, options)
        ref_torch = _reference_step(torch_prev, grad, k, options)
        chain = _reference_step(chain, grad, k, options)
        for i, name in enumerate(names):
            where = f"{case['name']} step {k} {name}"
            TOLERANCES[f"one_step.{name}"].check(
                ours[i],
                ref_ours[i],
                expected[i],
                torch_reference=ref_torch[i],
                what=f"{where} (one step)",
            )
            TOLERANCES[f"chain.{name}"].check(
                ours[i], chain[i], expected[i], what=f"{where} (chained from step 1)"
            )
        ours_prev = list(ours)
        torch_prev = [*expected, None] if not amsgrad else expected


def fp32_step_fn(case: dict, mistake: str | None = None) -> StepFn:
    """docs/design.md section 1 in FP32 for walk_case, one correctly rounded operation at a time,
    in the operation order of csrc/adamw_math.h; optionally with one `mistake` (see
    tests/test_tolerances.py). It checks the tolerance table without the extension,
    and the CPU kernel must reproduce it bit for bit (tests/test_fixtures.py).

    Only power-of-two gradient scales are modelled exactly (1 / scale is then exact).
    """
    hyper = case["hyperparameters"]
    lr, (beta1, beta2), eps, wd = (hyper[k] for k in ("lr", "betas", "eps", "weight_decay"))
    amsgrad = hyper["amsgrad"]

    def f32(x: float) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float32)

    # Correctly rounded FP32 division and square root, as in the kernels. torch's own
    # are not always: it divides by a scalar as a multiplication by the reciprocal, and
    # its CPU sqrt (FP32 and FP64) is not correctly rounded in every build. math.sqrt
    # is IEEE's, and the FP64 square root of an FP32 value rounded to FP32 is the
    # correctly rounded FP32 square root (53 >= 2 * 24 + 2 bits).
    def div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a / torch.full_like(a, b.item())

    def sqrt(a: torch.Tensor) -> torch.Tensor:
        roots = [math.sqrt(x) for x in a.reshape(-1).tolist()]
        return torch.tensor(roots, dtype=torch.float64).to(torch.float32).reshape(a.shape)

    def step_fn(param, grad, state, gradient_scale):
        m, v, v_max, t = state if state is not None else (0.0, 0.0, f32(0.0), 0)
        t += 1
        g = grad.to(torch.float32)
        if mistake == "fp16_subnormals_flushed" and grad.dtype == torch.float16:
            g = torch.where(g.abs() < torch.finfo(torch.float16).tiny, 0.0, g)
        g = g * f32((-1.0 if hyper["maximize"] else 1.0) / gradient_scale)  # exact: 2^k
        m = f32(beta1) * m + f32(1 - beta1) * g
        v = f32(beta2) * v + f32(1 - beta2) * (g * g)
        v_used = v
        if amsgrad:
            v_max = torch.maximum(v_max, v)
            v_used = v_max
        bc1 = f32(reference.bias_correction(beta1, t))
        bc2 = f32(reference.bias_correction(beta2, t))
        if mistake == "bias_correction_off_by_one":
            bc2 = f32(reference.bias_correction(beta2, t + 1))
        if mistake == "eps_inside_sqrt":
            denom = sqrt(div(v_used, bc2) + f32(eps))
        else:
            denom = sqrt(div(v_used, bc2)) + f32(eps)
        decay = f32(1 - lr * wd)
        if mistake == "weight_decay_after_update":
            new_param = (param - (f32(lr) * div(m, bc1)) / denom) * decay
        else:
            new_param = param * decay - (f32(lr) * div(m, bc1)) / denom
        if mistake == "amsgrad_stores_corrected_max" and amsgrad:
            v_max = div(v_max, bc2)
        return new_param, m, v, v_max if amsgrad else None, t, (m, v, v_max, t)

    return step_fn
