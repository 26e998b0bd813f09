"""Note [Division by a step constant] (csrc/adamw_math.h): for every FP32 x and every bias
correction bc = RN32(1 - beta^t) (a normal FP32 number in [2^-53, 1]), the FP32 quotient
x / bc equals the FP64 product of x and RN64(1 / bc), rounded once to FP32. The CUDA kernels
and the CPU's scalar loops divide so; the CPU's vector loops divide. Checked here on values
of every binade, subnormals, zeros, infinities and the largest FP32 values, against the
bias corrections of real steps and random ones, and near the quotients' rounding
boundaries (x = bc * (M +- tiny) for midpoints M), where a wrong rounding would show."""

from __future__ import annotations

import numpy as np
import pytest


def _bias_corrections(rng) -> np.ndarray:
    """RN32(1 - beta^t) as the kernels make them (FP64 power by repeated squaring, one cast),
    for the betas users pick and extreme ones, and random FP32 values in [2^-53, 1]."""
    out = []
    for beta in (0.0, 0.5, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 0.9999, 0.99999,
                 1.0 - 2.0**-53, 1.0 - 2.0**-30, 0.3):  # fmt: skip
        for t in (1, 2, 3, 7, 10, 100, 1000, 12345, 10**6, 2**40):
            p, b, e = 1.0, beta, t
            while e > 0:
                if e & 1:
                    p *= b
                b *= b
                e >>= 1
            out.append(np.float32(1.0 - p))
    exponents = rng.uniform(-53, 0, 20000)
    random = np.float32(2.0) ** exponents.astype(np.float32)
    random = (random * rng.uniform(1.0, 2.0, random.shape).astype(np.float32)).astype(np.float32)
    random = random[(random > 0) & (random <= 1)]
    return np.unique(np.concatenate([np.array(out, dtype=np.float32), random]))


def _values(rng, n: int) -> np.ndarray:
    """FP32 values of every binade (random bits), subnormals, specials and extremes."""
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 1.4e-45, -1.4e-45,
                        1.1754942e-38, 1.17549435e-38, 3.4028235e38, -3.4028235e38,
                        2.0**-149 * 3, 2.0**-149 * 9],
                       dtype=np.float32)  # fmt: skip
    sub = (rng.integers(1, 2**23, n // 4, dtype=np.int64).astype(np.uint32)).view(np.float32)
    return np.concatenate([x, special, sub, -sub])


def _product(x: np.ndarray, bc: np.float32) -> np.ndarray:
    inverse = np.float64(1.0) / np.float64(bc)
    return (x.astype(np.float64) * inverse).astype(np.float32)


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Where the FP32 values differ (any NaN equals any NaN: the kernels canonicalize)."""
    return ~((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b)))


def test_product_equals_division_everywhere():
    rng = np.random.default_rng(12345)
    x = _values(rng, 200_000)
    with np.errstate(all="ignore"):
        for bc in _bias_corrections(rng)[::7]:
            q = x / bc
            bad = _same(_product(x, bc), q)
            assert not bad.any(), (
                f"bc={bc!r}: {bad.sum()} quotients differ, e.g. x={x[bad][0]!r}: "
                f"{q[bad][0]!r} vs {_product(x[bad][:1], bc)[0]!r}"
            )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_product_equals_division_near_rounding_boundaries(seed):
    """x whose quotient x / bc is within a few FP32 units of a midpoint between two FP32
    values (x = RN32(bc * M) and its neighbours), normal and subnormal quotients."""
    rng = np.random.default_rng(seed)
    bcs = _bias_corrections(rng)[::3]
    with np.errstate(all="ignore"):
        for bc in bcs:
            # midpoints of random FP32 values q: q + ulp/2, and the FP32 x nearest bc * M
            q = _values(rng, 2000)
            q = q[np.isfinite(q)]
            up = np.nextafter(q, np.float32(np.inf))
            mid = (q.astype(np.float64) + up.astype(np.float64)) / 2
            x0 = (mid * np.float64(bc)).astype(np.float32)
            for x in (x0, np.nextafter(x0, np.float32(np.inf)),
                      np.nextafter(x0, np.float32(-np.inf))):  # fmt: skip
                bad = _same(_product(x, bc), x / bc)
                assert not bad.any(), (bc, x[bad][:3])
