"""The native functional API against torch.optim.AdamW's fixtures and the FP64 reference.

Each of the 12 fixture cases (fixtures/pytorch_fixtures.json) is stepped through
ruda_torch.adamw_step on the CPU kernels, and every step is checked against torch's
recorded result and the FP64 reference with the tolerance table of tests/tolerances.py
(Note [Tolerance tied to torch's own error]). The kernels are shared with CUDA
(csrc/adamw_math.h), so these checks speak for the GPU too.

This file needs the built extension: a failing `import ruda_torch` fails it, on purpose.
With a GPU, the same checks run on the CUDA kernels, plus bitwise CPU/CUDA parity.
"""

from __future__ import annotations

import pytest
import torch
from fixture_walk import CASE_IDS, CASES, fp32_step_fn, stored_gradient, walk_case

import ruda_torch

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def _native_step_fn(case: dict, device: str = "cpu"):
    hyper = case["hyperparameters"]
    options = ruda_torch.AdamWOptions(
        lr=hyper["lr"],
        betas=tuple(hyper["betas"]),
        eps=hyper["eps"],
        weight_decay=hyper["weight_decay"],
        amsgrad=hyper["amsgrad"],
        maximize=hyper["maximize"],
    )

    def step_fn(param, grad, state, gradient_scale):
        param, grad = param.to(device), grad.to(device)
        inputs = [param, grad]
        if state is not None:
            inputs += [state.step, state.exp_avg, state.exp_avg_sq]
            if state.max_exp_avg_sq is not None:
                inputs.append(state.max_exp_avg_sq)
        saved = [t.clone() for t in inputs]
        control = ruda_torch.StepControl(gradient_scale=gradient_scale, skip_update=False)
        result = ruda_torch.adamw_step(param, grad, state, options, control)

        assert result.updated is True
        # Out of place: no input changes (the gradient is never written, unlike torch's
        # fused path), and no output shares memory with an input.
        for before, after in zip(saved, inputs, strict=True):
            assert torch.equal(before, after), "adamw_step modified an input"
        new = result.state
        outputs = [result.parameters, new.step, new.exp_avg, new.exp_avg_sq]
        if new.max_exp_avg_sq is not None:
            outputs.append(new.max_exp_avg_sq)
        addresses = {t.untyped_storage().data_ptr() for t in inputs}
        for out in outputs:
            assert out.untyped_storage().data_ptr() not in addresses, "output aliases an input"
        assert new.step.dtype == torch.float32 and new.step.dim() == 0
        return (
            result.parameters,
            new.exp_avg,
            new.exp_avg_sq,
            new.max_exp_avg_sq,
            new.step,
            new,
        )

    return step_fn


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_adamw_step_matches_torch_and_fp64(case, device):
    walk_case(case, _native_step_fn(case, device))


# 128 keeps the largest FP16 fixture gradient (about 250) below FP16's 65504, and
# scaling by a power of two is exact (checked by stored_gradient), so the unscaled
# gradient, and hence every expected value, is the fixture's.
POWER_OF_TWO_SCALE = 128.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_adamw_step_with_gradient_scale_matches_torch_and_fp64(case, device):
    walk_case(case, _native_step_fn(case, device), gradient_scale=POWER_OF_TWO_SCALE)


def _same_bits(step_fn_a, step_fn_b, case: dict) -> None:
    """Run two step functions side by side from the case's initial parameter; require
    identical bits for every output at every step."""
    param = torch.tensor(case["initial_param"], dtype=torch.float32)
    run_a, run_b = (param, None), (param, None)
    for record in case["steps"]:
        grad = stored_gradient(case, record, 1.0)
        a = step_fn_a(run_a[0], grad, run_a[1], 1.0)
        b = step_fn_b(run_b[0], grad, run_b[1], 1.0)
        for name, x, y in zip(
            ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"), a[:5], b[:5], strict=True
        ):
            if x is None or y is None:
                assert x is None and y is None, name
                continue
            x = torch.as_tensor(x, dtype=torch.float32).cpu()
            y = torch.as_tensor(y, dtype=torch.float32).cpu()
            differ = (x != y).nonzero().flatten().tolist()
            assert not differ, (
                f"step {record['step']} {name}: {len(differ)} elements differ, e.g. element "
                f"{differ[0]}: {x.reshape(-1)[differ[0]].item()!r} vs {y.reshape(-1)[differ[0]].item()!r}"
            )
        run_a, run_b = (a[0], a[5]), (b[0], b[5])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_power_of_two_gradient_scale_is_exact(case):
    # g = stored * (1 / 2^k) is exact in FP32, so the update must be bit for bit the
    # unscaled one.
    step_fn = _native_step_fn(case)

    def scaled(param, grad, state, gradient_scale):
        stored = (grad.to(torch.float32) * POWER_OF_TWO_SCALE).to(grad.dtype)
        assert torch.equal(stored.to(torch.float64) / POWER_OF_TWO_SCALE, grad.to(torch.float64))
        return step_fn(param, stored, state, gradient_scale * POWER_OF_TWO_SCALE)

    _same_bits(step_fn, scaled, case)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cpu_kernel_is_correctly_rounded_fp32(case):
    # docs/design.md section 2: no FMA contraction, correctly rounded division and square root.
    # Then the kernel reproduces, bit for bit, docs/design.md section 1 evaluated one correctly
    # rounded FP32 operation at a time in csrc/adamw_math.h's order; a contracted
    # a*b+c, a reciprocal-multiply or an approximate square root changes some bits. This
    # is what lets CPU tests speak for the GPU (Note [One math, two backends]).
    _same_bits(_native_step_fn(case), fp32_step_fn(case), case)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cuda_matches_cpu_bit_for_bit(case):
    # One math header for both backends, no FMA contraction, correctly rounded division
    # and square root (docs/design.md section 2): the same inputs give the same bits.
    _same_bits(_native_step_fn(case, "cpu"), _native_step_fn(case, "cuda"), case)
