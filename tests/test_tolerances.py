"""The tolerance table is neither too loose nor too tight.

A plain FP32 evaluation of docs/design.md section 1 (fixture_walk.fp32_step_fn: every operation
correctly rounded, as the kernels do) must pass the fixture checks of
tests/test_fixtures.py, and the same evaluation with one classic mistake must fail
them. This runs without the native extension, so the tolerances are validated before
there is a kernel to blame.
"""

from __future__ import annotations

import math

import pytest
import torch
from fixture_walk import CASE_IDS, CASES, fp32_step_fn, grad_dtype, walk_case
from tolerances import FP32_EPS, TOLERANCES, assert_close_to_reference


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_correct_fp32_arithmetic_passes(case):
    walk_case(case, fp32_step_fn(case))


# (mistake, cases it shows up in)
MISTAKES = [
    ("eps_inside_sqrt", CASE_IDS),
    ("bias_correction_off_by_one", CASE_IDS),
    ("weight_decay_after_update", CASE_IDS),
    ("fp16_subnormals_flushed", [c["name"] for c in CASES if grad_dtype(c) == torch.float16]),
    ("amsgrad_stores_corrected_max", [c["name"] for c in CASES if c["hyperparameters"]["amsgrad"]]),
]


@pytest.mark.parametrize(
    ("mistake", "name"),
    [(mistake, name) for mistake, names in MISTAKES for name in names],
)
def test_formula_mistake_fails(mistake, name):
    case = CASES[CASE_IDS.index(name)]
    with pytest.raises(AssertionError, match="exceeds"):
        walk_case(case, fp32_step_fn(case, mistake))


def test_every_row_has_a_reason():
    for key, row in TOLERANCES.items():
        assert len(row.reason) > 40, key
        assert (row.factor is None) == (row.floor is None), key
        assert (row.factor is None) != (row.rtol is None), key
        if row.factor is not None:
            assert 1.0 <= row.factor <= 4.0, f"{key}: keep factors strict (2-4)"


def test_helper_on_a_two_dimensional_tensor():
    reference = torch.linspace(-3.0, 5.0, 12, dtype=torch.float64).reshape(3, 4)
    unit = FP32_EPS * 5.0  # global scale: max|reference| = 5
    torch_result = reference + unit  # torch is off by 1 unit everywhere
    ok = reference.clone()
    ok[2, 1] += 3.0 * unit
    assert_close_to_reference(ok, reference, torch_result, factor=3.0)
    bad = reference.clone()
    bad[2, 1] += 3.5 * unit
    with pytest.raises(AssertionError, match="worst element 9"):
        assert_close_to_reference(bad, reference, torch_result, factor=3.0)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_to_reference(
            reference.clone().fill_diagonal_(math.nan), reference, reference, factor=3.0
        )


def test_helper_elementwise_scale():
    reference = torch.tensor([1e-20, 1.0], dtype=torch.float64)
    # Far below a global unit (eps * 1.0), but 100 units of the tiny element itself.
    off = reference + torch.tensor([100 * FP32_EPS * 1e-20, 0.0], dtype=torch.float64)
    assert_close_to_reference(off, reference, reference, factor=3.0)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close_to_reference(off, reference, reference, factor=3.0, elementwise=True)
