"""The CPU kernels' ISA chosen at run time (Note [CPU ISA at run time] in
csrc/cpu/dispatch.cpp): every build this machine runs gives the bits of the portable
(default) build, for the update of every parameter and gradient dtype, the statistics
(non-finite values included) and the merges; the choice follows this CPU and the
environment variables, and is reported.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_stats import random_grad, run_analyze, run_merge

import ruda_torch
from ruda_torch import _build

RUNNABLE = [i for i in _build.CPU_ISAS_BUILT if i in _build.CPU_ISAS_SUPPORTED]
SIZES = [97, 1025, 65537, 0, 3 * 16384 + 5]
# Rows that are not whole blocks (Note [8-bit row blocks] in csrc/quant8.h): a row's last
# block shorter than 256 by a whole number of vectors or not (the one-pass way's scalar
# tail: Note [One pass per 8-bit block]), rows of one short block, rows of whole blocks.
ROW_SHAPES = [(13, 300), (40, 70), (9, 1000), (33, 128), (5, 4, 31), (7, 512)]
# The 4-bit moments' blocks of 128 (Note [4-bit row blocks] in csrc/quant4.h): rows of even
# length (4-bit needs it), a row's last block shorter by a whole number of vectors or not,
# rows of one short block, rows of whole blocks; and flat tensors of a short last block.
ROW_SHAPES_4BIT = [(13, 300), (40, 70), (9, 1000), (33, 128), (5, 4, 34), (7, 512), (2, 6)]
SIZES_4BIT = [98, 1026, 65538, 0, 3 * 16384 + 6]


@pytest.fixture
def restore_isa():
    yield
    _build.use_cpu_isa(_build.CPU_ISA)


def _train(kind: str) -> list[torch.Tensor]:
    """Every tensor a few steps of one configuration produce (parameters, state, report)."""
    gen = torch.Generator().manual_seed(17)
    pdtype = {"fp32": torch.float32, "fp64": torch.float64}.get(kind, torch.bfloat16)
    sizes = {"8bit-rows": ROW_SHAPES, "4bit": SIZES_4BIT, "4bit-rows": ROW_SHAPES_4BIT}.get(
        kind, SIZES
    )
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(pdtype)) for n in sizes]
    kw = dict(lr=1e-2, eps=1e-8, weight_decay=1e-2, fused_step=True)
    if kind == "fp32":
        kw.update(amsgrad=True, hierarchical_stats=True, max_grad_norm=0.5)
    elif kind == "bf16-master":
        kw.update(master_weights=True)
    elif kind == "bf16-remainder":  # Note [Remainder master]: vector loads, scalar splits
        kw.update(master_weights="remainder", amsgrad=True)
    elif kind == "bf16-sr":
        kw.update(stochastic_rounding=True, rounding_seed=3)
    elif kind in ("8bit", "8bit-rows"):  # the codes and scales of the 8-bit step (quant8.h)
        kw.update(amsgrad=True, state_precision="8bit", min_8bit_size=1000)
    elif kind in ("4bit", "4bit-rows"):  # the codes and scales of the 4-bit step (quant4.h)
        kw.update(amsgrad=True, state_precision="4bit", min_8bit_size=1000)
    opt = ruda_torch.AdamW(params, **kw)
    mixed = kind == "fp32" and hasattr(params[0], "grad_dtype")  # FP16 gradients (torch >= 2.14)
    if mixed:
        for p in params:
            p.grad_dtype = None
    out = []
    for step in range(3):
        for p in params:
            gdtype = torch.float16 if mixed and step == 1 else p.dtype
            p.grad = (torch.randn(p.shape, generator=gen) * 3).to(gdtype)
        if kind == "8bit" and step == 1:
            # An infinite second moment (1e30 squared) in one block of the longest tensor:
            # that block takes the per-pass path from then on, between blocks that do not
            # (Note [One pass per 8-bit block]).
            params[2].grad[70 * 256 + 3] = 1e30
        if kind in ("8bit-rows", "4bit-rows") and step == 1:  # in a row's shorter last block
            params[0].grad[7, 260] = 1e30
        if kind == "4bit" and step == 1:  # one block of 128 among vector ones
            params[2].grad[70 * 128 + 3] = 1e30
        opt.step()
        out += [p.detach().clone() for p in params]
        out += [v.clone() for p in params for v in opt.state[p].values()]
        if opt.last_report is not None:
            out.append(opt.last_report.tensor.clone())
    return out


def _stats_inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(23)
    out = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        grads = [random_grad(gen, n, dtype) for n in SIZES]
        grads[1][5] = float("inf")
        grads[2][70000 % grads[2].numel()] = float("nan")
        for scale in (None, 1024.0):
            rows = run_analyze(grads, scale)
            out += [rows, run_merge(rows)]
    chunks = torch.randn(7, 3, generator=gen).abs()
    merged = torch.empty(3)
    ruda_torch.ops.merge_gradient_stats_chunks(chunks, merged)
    for code in ruda_torch.ops.CODES_8BIT:  # the 8-bit codec, over 24 binades of values
        x = torch.randn(65537, generator=gen) * torch.exp2(
            torch.randint(-24, 0, (65537,), generator=gen).float()
        )
        codes, scales = ruda_torch.ops.quantize_8bit(x, code)
        out += [codes, scales, ruda_torch.ops.dequantize_8bit(codes, scales, code)]
    return out + [merged]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(
        {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
    )


@pytest.mark.parametrize("isa", RUNNABLE)
def test_every_isa_build_gives_the_default_bits(isa, restore_isa):
    results = {}
    for build in dict.fromkeys(["default", isa]):
        assert _build.use_cpu_isa(build) == build
        kinds = ("fp32", "fp64", "bf16-master", "bf16-remainder", "bf16-sr", "8bit", "8bit-rows",
                 "4bit", "4bit-rows")  # fmt: skip
        results[build] = [_train(k) for k in kinds]
        results[build].append(_stats_inputs())
    for got_set, want_set in zip(results[isa], results["default"], strict=True):
        for j, (got, want) in enumerate(zip(got_set, want_set, strict=True)):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(_bits(got), _bits(want)), f"{isa}: tensor {j} differs"


def test_the_best_build_this_cpu_runs_is_chosen():
    assert ruda_torch.cpu_capability() == _build.CPU_ISA
    if not any(k in os.environ for k in (_build.ISA_ENV, "ATEN_CPU_CAPABILITY")):
        assert _build.CPU_ISA == RUNNABLE[-1]
    assert "default" in _build.CPU_ISAS_BUILT and "default" in _build.CPU_ISAS_SUPPORTED


@pytest.mark.parametrize(
    "requested,built,supported,chosen,warns",
    [
        (None, ("default", "avx2", "avx512"), ("default", "avx2"), "avx2", False),
        ("DEFAULT", ("default", "avx2"), ("default", "avx2"), "default", False),
        ("avx512", ("default", "avx2", "avx512"), ("default", "avx2"), "avx2", True),
        ("avx512", ("default", "avx2"), ("default", "avx2", "avx512"), "avx2", True),
        (None, ("default",), ("default", "avx2", "avx512"), "default", False),
    ],
)
def test_choice_rules(requested, built, supported, chosen, warns):
    got, note = _build.choose_cpu_isa(requested, built, supported)
    assert got == chosen
    assert (note is not None) == warns
    if warns:
        assert _build.ISA_ENV in note and chosen in note


def test_unknown_request_is_an_error_that_names_the_variable():
    with pytest.raises(ValueError, match="RUDA_TORCH_CPU_CAPABILITY.*default, avx2, avx512"):
        _build.choose_cpu_isa("sse9", ("default",), ("default",))


@pytest.mark.parametrize("variable", [_build.ISA_ENV, "ATEN_CPU_CAPABILITY"])
def test_environment_selects_the_build(variable):
    env = {k: v for k, v in os.environ.items() if k not in (_build.ISA_ENV, "ATEN_CPU_CAPABILITY")}
    env[variable] = "default"
    run = subprocess.run(
        [sys.executable, "-c", "import ruda_torch; print(ruda_torch.cpu_capability())"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "default"


def _codec_inputs(code: str) -> torch.Tensor:
    """Values q of every class the 8-bit codec rounds differently (Note [8-bit codes
    through FP16] in csrc/cpu/kernels/quant8_vec.h): every FP16 value below 2 (and, for
    the signed code, times 2^8: the FP16 grid it converts on) with its FP32 neighbours,
    every midpoint between adjacent codes with its neighbours, FP32 subnormals, zeros,
    and random bit patterns in [0, 1]; signs random for the signed code."""
    gen = torch.Generator().manual_seed(5)
    halves = torch.arange(0, 0x4000, dtype=torch.int16).view(torch.float16).float()
    grids = [halves, halves * 256.0] if code == "signed" else [halves]
    decoded = ruda_torch.ops.dequantize_8bit(
        torch.arange(256, dtype=torch.uint8), torch.ones(1), code
    ).abs()
    codes = torch.unique(decoded[torch.isfinite(decoded)])
    mids = (codes[1:].double() + codes[:-1].double()).div(2).float()  # exact in FP32
    base = torch.cat([*grids, codes, mids])
    bits = base.view(torch.int32)
    near = torch.cat([bits + d for d in (-2, -1, 0, 1, 2)]).clamp(0, 0x3F800000)
    patterns = torch.randint(0, 0x3F800001, (1 << 20,), generator=gen, dtype=torch.int32)
    tiny = torch.arange(0, 4096, dtype=torch.int32)  # FP32 subnormals and +0
    q = torch.cat([near, patterns, tiny]).view(torch.float32)
    if code == "signed":
        q = torch.where(torch.rand(q.shape, generator=gen) < 0.5, -q, q)
    # Blocks of 256 whose largest magnitude is 1: scale 1, inverse 1, so the codec sees q.
    rows = (q.numel() + 254) // 255
    values = torch.zeros(rows * 255)
    values[: q.numel()] = q
    return torch.cat([torch.ones(rows, 1), values.view(rows, 255)], dim=1).view(-1)


@pytest.fixture(params=[False, True], ids=["denormals", "flush-denormals"])
def flush_denormal(request):
    """torch.set_flush_denormal (MXCSR's DAZ and FTZ on x86): the codes must not change."""
    if request.param and not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no denormal flushing")
    yield request.param
    torch.set_flush_denormal(False)


# Scales of every kind (tiny, huge, zero, the negated scales of blocks with non-finite
# values, an earlier format's NaN scale of either sign, infinity): the vector decoders take
# the finite ones only.
EVERY_SCALE = [1.0, 3.0e38, 1.5e-38, 0.0, 7.25e-3, 2.0**-100, -1.0, -3.0e38, -0.0,
               float("nan"), -float("nan"), float("inf")]  # fmt: skip


def _codec_on_both_builds(isa: str, bits: int, x: torch.Tensor, code: str):
    """quantize_<bits>bit and dequantize_<bits>bit of x on the default build and on `isa`,
    and every byte decoded under EVERY_SCALE, compared bit for bit; returns isa's
    (codes, scales, values). Denormal flushing is off again after (the fixture's state
    was on while they ran)."""
    quantize = getattr(ruda_torch.ops, f"quantize_{bits}bit")
    dequantize = getattr(ruda_torch.ops, f"dequantize_{bits}bit")
    scales = torch.tensor(EVERY_SCALE)
    # 256 bytes a scale (8 bits), or 64 (4 bits: 128 codes)
    every = torch.arange(256, dtype=torch.uint8).repeat(scales.numel() // (1 if bits == 8 else 4))
    results, decoded = {}, {}
    for build in dict.fromkeys(["default", isa]):
        assert _build.use_cpu_isa(build) == build
        codes, scale = quantize(x, code)
        results[build] = (codes, scale, dequantize(codes, scale, code))
        decoded[build] = dequantize(every, scales, code)
    torch.set_flush_denormal(False)
    assert torch.equal(results[isa][0], results["default"][0]), f"{isa}: codes differ"
    for got, want in zip(results[isa][1:], results["default"][1:], strict=True):
        assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(decoded[isa]), _bits(decoded["default"]))
    return results[isa]


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("code", ["signed", "unsigned"])
def test_8bit_codec_gives_the_default_bits_on_every_class_of_value(
    isa, code, restore_isa, flush_denormal
):
    codes, _, _ = _codec_on_both_builds(isa, 8, _codec_inputs(code), code)
    # Not a vacuous comparison: every code of a value in [-1, 1] occurs (signed: 113
    # magnitudes 0 .. 0x70, each with both signs but 0; unsigned: 0 .. 0xF0).
    assert len(torch.unique(codes)) == (225 if code == "signed" else 241)


def _codec4_inputs(code: str) -> torch.Tensor:
    """Values y = |x| * inverse of every class the 4-bit codec rounds differently: every
    code's value and every midpoint between adjacent codes with their FP32 neighbours,
    FP32 subnormals, zeros, random bit patterns in [0, top]; signs random for the signed
    code. Each block of 128 leads with its largest magnitude 1 (scale 1), so the codec
    sees top * q."""
    gen = torch.Generator().manual_seed(7)
    top = 1.5 if code == "signed" else 1.75
    decoded = ruda_torch.ops.dequantize_4bit(
        torch.arange(256, dtype=torch.uint8), torch.ones(4), code
    ).abs()
    codes = torch.unique(decoded[torch.isfinite(decoded)])
    mids = (codes[1:].double() + codes[:-1].double()).div(2).float()
    bits = torch.cat([codes, mids]).view(torch.int32)
    near = torch.cat([bits + d for d in range(-3, 4)]).clamp(0, 0x3F800000)
    patterns = torch.randint(0, 0x3F800001, (1 << 18,), generator=gen, dtype=torch.int32)
    tiny = torch.arange(0, 4096, dtype=torch.int32)
    q = torch.cat([near, patterns, tiny]).view(torch.float32).clamp(max=1.0)
    if code == "signed":
        q = torch.where(torch.rand(q.shape, generator=gen) < 0.5, -q, q)
    rows = (q.numel() + 126) // 127
    values = torch.zeros(rows * 127)
    values[: q.numel()] = q
    assert top > 1.0  # the codec's own scaling (top / scale) maps q = 1 to its top code
    return torch.cat([torch.ones(rows, 1), values.view(rows, 127)], dim=1).view(-1)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("code", ["signed", "unsigned"])
def test_4bit_codec_gives_the_default_bits_on_every_class_of_value(
    isa, code, restore_isa, flush_denormal
):
    finite = _codec4_inputs(code)
    # Blocks of non-finite values (the special scale) and a short last block among them (90
    # elements: with AVX2 two pairs of vectors, one vector and two scalars).
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.5] * 32)
    x = torch.cat([finite, special, finite[:90]])
    codes, scales, values = _codec_on_both_builds(isa, 4, x, code)
    # Not vacuous: every code of a finite block occurs (signed: all but -0, code 8; unsigned:
    # all 16), and the special block's infinities and NaN.
    coded = codes[: finite.numel() // 2]
    nibbles = torch.cat([coded & 15, coded >> 4])
    assert len(torch.unique(nibbles)) == (15 if code == "signed" else 16)
    assert torch.isnan(values[finite.numel() + 2]) and scales[-2] < 0
