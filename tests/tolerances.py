"""The tolerance table: every numerical comparison in the tests, with its reason.

Note [Tolerance tied to torch's own error]
An FP32 optimizer cannot match an FP64 reference exactly, and "how close is close
enough" must not be a number picked until the tests pass. As flash-attention does, we
measure torch.optim.AdamW's own error against the FP64 reference
(ruda_torch/reference.py) on the same inputs, and require ours to be at most a small
multiple of it:

    error(ours)  <=  factor * max(error(torch), floor)

Errors are measured in units of FP32 epsilon (2**-23) times a magnitude of the
reference, i.e. 1 to 2 FP32 ulps, so that one table serves tensors of any scale:

- "global" scale: the magnitude is max|reference| over the tensor. Used for the
  parameter and the first moment, whose elements can cancel (p - update, beta1 * m +
  (1 - beta1) * g with opposite signs): an element near zero has a large error
  relative to itself in every FP32 implementation, and which implementation happens to
  be worst on that one element is an accident of operation order.
- "elementwise" scale: each element's own |reference|. Used for the second moment and
  the AMSGrad maximum, sums of non-negative terms that cannot cancel, so each element
  is accurate to a few ulps of itself; this catches mistakes on the tiny gradients
  (e.g. FP16 subnormals flushed to zero) that a global scale would hide.

The floor keeps the bound meaningful when torch happens to be exact (or nearly so) on
some quantity: correct rounding of the final operation alone costs up to half an ulp,
and our kernel orders its operations differently from torch, so a perfect torch does
not oblige us to be perfect too. The floor is 1 unit (1-2 ulps).

Closeness to torch itself follows: by the triangle inequality
|ours - torch| <= error(ours) + error(torch) <= (factor + 1) * max(error(torch), floor).

What the factor buys: docs/design.md section 1 evaluated one correctly rounded FP32 operation at
a time in csrc/adamw_math.h's order (which is, bit for bit, what the CPU kernel
computes) stays within 1.1 units per step and 2.0 units after 5 chained steps on the
fixture cases, against torch's 1.0 and 1.9 (torch's CPU square root is not correctly
rounded, which adds to its error); that is at most half of the bound, and a factor of
3 leaves room for that difference and little more. Formula mistakes cost from tens of units (weight decay applied after
the update instead of before) to thousands and more (epsilon inside the square root,
FP16 subnormal gradients flushed to zero, bias correction off by one step);
tests/test_tolerances.py checks both directions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP32_EPS = 2.0**-23  # distance from 1.0 to the next FP32 value
FP32_TINY = 2.0**-126  # smallest normal FP32 value: the scale of an all-zero reference


@dataclass(frozen=True)
class Tolerance:
    """One row of the table: how a quantity is compared, and why."""

    reason: str
    factor: float | None = None  # ours <= factor * max(torch, floor), in error units
    floor: float | None = None  # error units (FP32 eps x magnitude)
    elementwise: bool = False  # scale each element by its own |reference|
    rtol: float | None = None  # plain relative tolerance (FP64 vs FP64 comparisons)

    def check(self, actual, reference_fp64, torch_result, *, what: str, torch_reference=None):
        """assert_close_to_reference with this row's factor, floor and scale."""
        assert self.factor is not None and self.floor is not None, f"{what}: not a factor row"
        assert_close_to_reference(
            actual,
            reference_fp64,
            torch_result,
            factor=self.factor,
            floor=self.floor,
            elementwise=self.elementwise,
            torch_reference=torch_reference,
            what=what,
        )


_ONE_STEP = (
    "one step from identical FP32 inputs: each implementation's rounding of docs/design.md "
    "section 1 is 1-2 ulps and the two order their operations differently"
)
_CHAIN = (
    "several chained steps (5 in the fixtures), each implementation on its own state: "
    "rounding errors add up over the steps (no amplification: the moments do not depend on the parameter, and weight "
    "decay contracts), about equally for both"
)
_CANCELS = "global scale, its elements cancel (Note [Tolerance tied to torch's own error])"
_NO_CANCEL = "elementwise scale, a sum of non-negative terms that cannot cancel"

TOLERANCES: dict[str, Tolerance] = {
    # FP32 implementations (ours, torch) against the FP64 reference.
    "one_step.param": Tolerance(f"{_ONE_STEP}; {_CANCELS}", factor=3.0, floor=1.0),
    "one_step.exp_avg": Tolerance(f"{_ONE_STEP}; {_CANCELS}", factor=3.0, floor=1.0),
    "one_step.exp_avg_sq": Tolerance(
        f"{_ONE_STEP}; {_NO_CANCEL}", factor=3.0, floor=1.0, elementwise=True
    ),
    "one_step.max_exp_avg_sq": Tolerance(
        f"{_ONE_STEP}; {_NO_CANCEL} (the maximum itself is exact)",
        factor=3.0,
        floor=1.0,
        elementwise=True,
    ),
    "chain.param": Tolerance(f"{_CHAIN}; {_CANCELS}", factor=3.0, floor=1.0),
    "chain.exp_avg": Tolerance(f"{_CHAIN}; {_CANCELS}", factor=3.0, floor=1.0),
    "chain.exp_avg_sq": Tolerance(
        f"{_CHAIN}; {_NO_CANCEL}", factor=3.0, floor=1.0, elementwise=True
    ),
    "chain.max_exp_avg_sq": Tolerance(
        f"{_CHAIN}; {_NO_CANCEL}", factor=3.0, floor=1.0, elementwise=True
    ),
    # FP64 against FP64.
    "reference_vs_torch_float64": Tolerance(
        "the FP64 reference against torch.optim.AdamW run in float64: the same formula "
        "in a different operation order (torch uses lerp for m and divides sqrt(v) by "
        "sqrt(1 - beta2^t)), so each value differs by a few FP64 ulps (1e-16) per step; "
        "1e-12 relative to each element, or to the tensor's largest element where values "
        "cancel, is 1e4 times that and still 1e5 times below FP32 resolution, so it "
        "cannot hide an FP32-sized mistake",
        rtol=1e-12,
    ),
    "bias_correction_vs_pow": Tolerance(
        "1 - beta^t by repeated squaring against 1 - Python's pow: each squaring doubles "
        "the relative error beta^(2^k) carries, so beta^t is off by up to about t FP64 "
        "ulps of itself; relative to 1 - beta^t that peaks near 1 / (1 - beta) ulps "
        "(3.7e-13 measured for beta = 0.9999, t = 3). 1e-11 is 25 times that, and still "
        "1e4 times below FP32 resolution, at which the kernels use the value",
        rtol=1e-11,
    ),
    # 16-bit parameters (tests/test_optimizer_dtypes.py). The kernel-level tests need no
    # row: a 16-bit step is checked bit for bit against the FP32 kernel followed by torch's
    # round-to-nearest-even (tests/test_param_dtypes.py).
    "bf16_params_vs_torch_fp32_rounded": Tolerance(
        "BF16 parameters stepped by ours against torch's FP32 step from the same widened "
        "parameters, rounded to BF16 after every step: the two FP32 results differ by a few "
        "FP32 ulps (Note [Optimizer-level tolerance]), which moves the rounded value only "
        "where the FP32 result lies within those ulps of a rounding boundary: by one BF16 "
        "ulp (2^-8 relative, with 1% slack) on at most 2% of the elements (none measured: "
        "8 steps of 2,205 elements, AdamW and AMSGrad)",
        rtol=2.0**-8 * 1.01,
    ),
    "fp16_params_vs_torch_fp32_rounded": Tolerance(
        "the same for FP16 parameters: one FP16 ulp (2^-11 relative, with 1% slack) on at "
        "most 2% of the elements",
        rtol=2.0**-11 * 1.01,
    ),
    "global_norm_vs_fsum": Tolerance(
        "FP64 torch.sum against math.fsum (exactly rounded) over at most a few thousand "
        "non-negative terms: n * 2^-53 relative at worst",
        rtol=1e-12,
    ),
}


def _error_units(values: torch.Tensor, reference: torch.Tensor, elementwise: bool) -> torch.Tensor:
    if elementwise:
        scale = reference.abs().clamp(min=FP32_TINY)
    else:
        largest = reference.abs().max().item() if reference.numel() else 0.0
        scale = torch.tensor(max(largest, FP32_TINY), dtype=torch.float64)
    return (values - reference).abs() / (FP32_EPS * scale)


def assert_close_to_reference(
    actual: torch.Tensor,
    reference_fp64: torch.Tensor,
    torch_result: torch.Tensor,
    *,
    factor: float,
    floor: float = 1.0,
    elementwise: bool = False,
    torch_reference: torch.Tensor | None = None,
    what: str = "value",
) -> None:
    """Require max error(actual) <= factor * max(max error(torch_result), floor).

    Errors are |x - reference| in units of FP32 eps times max|reference| (or, with
    ``elementwise``, times each element's own |reference|); see
    Note [Tolerance tied to torch's own error]. ``reference_fp64`` is the FP64 result on
    the inputs ``actual`` was computed from; ``torch_reference`` is the one on torch's
    inputs when those differ (one-step checks, each implementation on its own previous
    state), by default the same. NaN or inf in ``actual`` fails.
    """
    reference = reference_fp64.detach().to("cpu", torch.float64)
    if torch_reference is None:
        theirs_reference = reference
    else:
        theirs_reference = torch_reference.detach().to("cpu", torch.float64)
    ours = actual.detach().to("cpu", torch.float64)
    theirs = torch_result.detach().to("cpu", torch.float64)
    assert ours.shape == reference.shape == theirs.shape == theirs_reference.shape, (
        f"{what}: shapes differ: ours {list(ours.shape)}, reference "
        f"{list(reference.shape)}, torch {list(theirs.shape)}"
    )
    for ref in (reference, theirs_reference):
        assert bool(torch.isfinite(ref).all()), f"{what}: the FP64 reference is not finite"
    if reference.numel() == 0:
        return
    assert bool(torch.isfinite(ours).all()), f"{what}: non-finite values {ours}"
    ours_err = _error_units(ours, reference, elementwise).reshape(-1)
    torch_err = _error_units(theirs, theirs_reference, elementwise).max().item()
    bound = factor * max(torch_err, floor)
    worst = int(ours_err.argmax().item())
    assert ours_err[worst].item() <= bound, (
        f"{what}: error {ours_err[worst].item():.4g} units vs FP64 exceeds {factor} x "
        f"max(torch's {torch_err:.4g}, floor {floor}) = {bound:.4g} units "
        f"(unit = FP32 eps x {'|reference|' if elementwise else 'max|reference|'}); "
        f"worst element {worst}: ours {ours.reshape(-1)[worst].item()!r}, FP64 "
        f"{reference.reshape(-1)[worst].item()!r}, torch {theirs.reshape(-1)[worst].item()!r}"
    )
