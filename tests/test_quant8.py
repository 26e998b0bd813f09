"""Blockwise 8-bit codes of the moments (Note [8-bit moments] in csrc/quant8.h):
``ruda_torch.ops.quantize_8bit`` / ``dequantize_8bit`` on the CPU against the reference
that defines them by value (ruda_torch/reference.py: every code's value in FP64, the
nearest code, ties to the even code), bit for bit; the error bounds the format promises;
the rules at the edges (zeros, values below the smallest code, non-finite blocks, tiny
blocks); validation. The emulated CUDA kernels are compared with these in
tests/test_cuda_sim.py, the real ones in tests/test_gpu_ops.py."""

from __future__ import annotations

import math

import pytest
import torch

from ruda_torch import ops
from ruda_torch.reference import dequantize_8bit_reference, quantize_8bit_reference

SIZES = [0, 1, 97, 256, 1025, 65537]
CODES = ops.CODES_8BIT
# Smallest normal magnitude of q and the relative half-spacing of 4 mantissa bits.
SMALLEST_NORMAL = {"signed": 2.0**-6, "unsigned": 2.0**-14}
HALF_SPACING = 2.0**-5


def _inputs(n: int, code: str, spread: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * spread)
    return x.abs() if code == "unsigned" else x


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN of any payload equal to NaN (the reference's NaN is torch's)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(
        a[~nan].view(torch.int32), b[~nan].view(torch.int32)
    )


def _both(x: torch.Tensor, code: str):
    codes, scales = ops.quantize_8bit(x, code)
    ref_codes, ref_scales = quantize_8bit_reference(x, code)
    return codes, scales, ref_codes, ref_scales


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("spread", [0.0, 1.0, 4.0], ids=["gaussian", "lognormal", "wide"])
def test_codes_equal_the_reference_bit_for_bit(code, n, spread):
    x = _inputs(n, code, spread, seed=n + int(spread * 10))
    codes, scales, ref_codes, ref_scales = _both(x, code)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scales.shape == (-(-n // ops.BLOCK_8BIT),)
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32))
    assert torch.equal(codes, ref_codes), f"{(codes != ref_codes).sum()} codes differ"
    decoded = ops.dequantize_8bit(codes, scales, code)
    ref = dequantize_8bit_reference(codes, scales, code)
    assert torch.equal(decoded.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("code", CODES)
def test_ties_round_to_the_even_code(code):
    """q exactly halfway between two neighbouring codes (a power-of-two scale keeps q
    exact) takes the even one; just above or below it, the nearer one."""
    values = dequantize_8bit_reference(
        torch.arange(256 if code == "unsigned" else 128, dtype=torch.uint8),
        torch.ones(1),
        code,
    ).double()
    k = torch.arange(1, values.numel() - 1)
    k = k[values[k + 1] <= 1.0]  # codes within the range of q
    mid = ((values[k] + values[k + 1]) / 2).float()
    assert torch.equal(mid.double(), (values[k] + values[k + 1]) / 2)  # exact midpoints
    for offset, expect in ((0, None), (1, k), (-1, k + 1)):
        x = mid.clone()
        if offset:  # one FP32 ulp towards code k (offset 1) or k + 1
            x = torch.nextafter(x, torch.full_like(x, -offset * 10.0))
        x = torch.cat([x, torch.ones(1)])  # the block's scale: 1.0
        codes, scales = ops.quantize_8bit(x, code)
        assert scales[0] == 1.0
        got = codes[:-1].long()
        want = torch.where(k % 2 == 0, k, k + 1) if expect is None else expect
        assert torch.equal(got, want), (offset, (got != want).nonzero()[:5])


@pytest.mark.parametrize("code", CODES)
def test_every_code_decodes_and_encodes_back(code):
    """Each code's value, scaled back by a block whose largest magnitude is 1, is coded as
    that code again (the nearest value to a code's value is itself)."""
    n_codes = 256 if code == "unsigned" else 128
    all_codes = torch.arange(n_codes, dtype=torch.uint8)
    values = dequantize_8bit_reference(all_codes, torch.ones(1), code)
    keep = values <= 1.0
    x = torch.cat([values[keep], torch.ones(1)])
    codes, _ = ops.quantize_8bit(x, code)
    assert torch.equal(codes[:-1], all_codes[keep])
    if code == "signed":  # and the negative codes
        codes, _ = ops.quantize_8bit(torch.cat([-values[keep][1:], torch.ones(1)]), code)
        assert torch.equal(codes[:-1], all_codes[keep][1:] | 0x80)


@pytest.mark.parametrize("code", CODES)
def test_error_bound_in_the_normal_range(code):
    """Where |x| / scale is at least the smallest normal code, the decoded value is within
    half a code spacing (2^-5 relative) of x, plus FP32's roundings of q and of the
    product."""
    x = _inputs(65537, code, 1.0, seed=11)
    codes, scales = ops.quantize_8bit(x, code)
    decoded = ops.dequantize_8bit(codes, scales, code)
    block = torch.arange(x.numel()) // ops.BLOCK_8BIT
    normal = x.abs() >= SMALLEST_NORMAL[code] * scales[block]
    assert normal.float().mean() > 0.5
    rel = ((decoded - x).abs() / x.abs())[normal]
    assert rel.max() <= HALF_SPACING * (1 + 2**-20) + 2**-22
    assert rel.max() > HALF_SPACING * 0.9  # the bound is reached: the test can fail
    assert (decoded.sign() == x.sign())[normal].all()


def test_below_the_smallest_code():
    """A first moment below half the smallest code is stored as zero; a positive second
    moment never is (it rounds up to the smallest code: a second moment decoded too small
    would make the step too large); -0.0 is zero in both."""
    x = torch.tensor([1.0, 2.0**-12, -(2.0**-12), -0.0, 0.0])  # half the smallest: 2^-11
    codes, _ = ops.quantize_8bit(x, "signed")
    assert codes[1:].tolist() == [0, 0, 0, 0]
    x = torch.tensor([1.0, 2.0**-20, 2.0**-30, -0.0, 0.0])  # half the smallest: 2^-19
    codes, _ = ops.quantize_8bit(x, "unsigned")
    assert codes[1:].tolist() == [1, 1, 0, 0]
    smallest = ops.dequantize_8bit(torch.tensor([1], dtype=torch.uint8), torch.ones(1), "unsigned")
    assert smallest.item() == 2.0**-18


@pytest.mark.parametrize("code", CODES)
def test_non_finite_and_tiny_blocks(code):
    """A block with a NaN or an infinity keeps them in their elements (special codes) and
    its finite values coded against its largest finite magnitude, its scale negated; a
    block whose largest finite magnitude is below 2^-126 is stored as zeros (scale -0.0
    beside an infinity); the blocks around them are unaffected."""
    x = _inputs(7 * 256, code, 1.0, seed=3)
    x[256 + 17] = float("nan")
    x[512 + 3] = float("inf")
    x[512 + 4] = float("-inf")
    x[768:1024] = x[768:1024].sign() * 1e-39  # subnormal FP32
    x[1024:1280] = x[1024:1280].sign() * 1e-39
    x[1024 + 9] = float("inf")
    x[1280:1536] = float("nan")
    codes, scales = ops.quantize_8bit(x, code)
    ref_codes, ref_scales = quantize_8bit_reference(x, code)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32))
    finite_part = x.clone()
    finite_part[~torch.isfinite(x)] = 0
    for b in (1, 2):  # the scale: minus the largest finite magnitude
        part = slice(256 * b, 256 * (b + 1))
        assert scales[b] == -finite_part[part].abs().max()
    assert scales[3] == 0 and not scales[3].signbit()
    assert scales[4] == 0 and scales[4].signbit()
    assert scales[5] == 0 and scales[5].signbit()  # all NaN: no finite value
    decoded = ops.dequantize_8bit(codes, scales, code)
    assert _same_values(decoded, dequantize_8bit_reference(codes, scales, code))
    special = ~torch.isfinite(x)
    assert torch.equal(decoded[special].isnan(), x[special].isnan())
    inf = torch.isinf(x)
    want_inf = x[inf] if code == "signed" else x[inf].abs()
    assert torch.equal(decoded[inf], want_inf)
    assert torch.isfinite(decoded[~special]).all()
    assert (decoded[768:1024] == 0).all() and (decoded[1024:1280][~special[1024:1280]] == 0).all()
    for b in (0, 6):
        part = slice(256 * b, 256 * (b + 1))
        alone, _ = ops.quantize_8bit(x[part].clone(), code)
        assert torch.equal(codes[part], alone)
    for b in (1, 2):  # the finite values code as they would in a block without the others
        part = slice(256 * b, 256 * (b + 1))
        alone, alone_scale = ops.quantize_8bit(finite_part[part].clone(), code)
        keep = torch.isfinite(x[part])
        assert torch.equal(codes[part][keep], alone[keep])
        assert torch.equal(decoded[part][keep], ops.dequantize_8bit(alone, alone_scale, code)[keep])


@pytest.mark.parametrize("code", CODES)
def test_special_codes_are_no_finite_value(code):
    """No finite block codes 0x7E/0x7F (signed magnitude) or 0xFE/0xFF (unsigned), and
    q = 1 (the largest) codes 0x70 / 0xF0: the special codes cannot be met in a block
    whose scale is its largest magnitude."""
    x = _inputs(65536, code, 4.0, seed=11)
    codes, _ = ops.quantize_8bit(x, code)
    magnitude = codes.long() & 0x7F if code == "signed" else codes.long()
    assert magnitude.max().item() == (0x70 if code == "signed" else 0xF0)


@pytest.mark.parametrize("code", CODES)
def test_earlier_format_non_finite_block_decodes_as_nan(code):
    """A checkpoint written before the special codes stored a block with a non-finite
    value as scale NaN (sign bit clear) and codes 0: it decodes as every element NaN."""
    codes = torch.zeros(512, dtype=torch.uint8)
    codes[256:] = 0x30
    scales = torch.tensor([float("nan"), 2.0])
    decoded = ops.dequantize_8bit(codes, scales, code)
    assert decoded[:256].isnan().all() and torch.isfinite(decoded[256:]).all()
    assert _same_values(decoded, dequantize_8bit_reference(codes, scales, code))


def test_unsigned_codes_store_magnitudes():
    x = _inputs(1025, "signed", 1.0, seed=5)
    assert torch.equal(
        ops.quantize_8bit(x, "unsigned")[0], ops.quantize_8bit(x.abs(), "unsigned")[0]
    )


def test_layouts_and_out():
    """Blocks follow x's elements in row-major order whatever its strides; dequantize
    writes into a given out."""
    x = _inputs(40 * 30, "signed", 1.0, seed=6).view(40, 30)
    codes, scales = ops.quantize_8bit(x.t(), "signed")
    want_codes, want_scales = ops.quantize_8bit(x.t().contiguous(), "signed")
    assert codes.shape == (30, 40) and torch.equal(codes, want_codes)
    assert torch.equal(scales, want_scales)
    out = torch.empty(30, 40)
    assert ops.dequantize_8bit(codes, scales, "signed", out=out) is out
    assert torch.equal(out, ops.dequantize_8bit(codes, scales, "signed"))


def test_errors_name_the_argument_and_write_nothing():
    x = torch.randn(300)
    with pytest.raises(ValueError, match="code must be 'signed'.*'unsigned'.*got 'int8'"):
        ops.quantize_8bit(x, "int8")
    with pytest.raises(TypeError, match="x must be a float32 tensor"):
        ops.quantize_8bit(x.double(), "signed")
    q = torch.ops.ruda_torch.quantize_8bit
    codes, scales = torch.full((300,), 7, dtype=torch.uint8), torch.full((2,), 5.0)
    with pytest.raises(RuntimeError, match="scales must be a contiguous float32 tensor of 2"):
        q(x, codes, torch.empty(3), 0)
    with pytest.raises(RuntimeError, match="codes must be a contiguous uint8 tensor of 300"):
        q(x, torch.empty(300, dtype=torch.int8), scales, 0)
    with pytest.raises(RuntimeError, match="code must be 0"):
        q(x, codes, scales, 2)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32 tensor"):
        q(torch.randn(20, 15).t(), codes, scales, 0)
    assert (codes == 7).all() and (scales == 5.0).all()
    d = torch.ops.ruda_torch.dequantize_8bit
    out = torch.full((300,), 3.0)
    with pytest.raises(RuntimeError, match="out must be a contiguous float32 tensor"):
        d(codes, scales, torch.empty(300, dtype=torch.float64), 0)
    with pytest.raises(RuntimeError, match="scales must be .* of 2 elements"):
        d(codes, torch.ones(1), out, 0)
    buf = torch.full((302,), 3.0)
    shared_scales, overlapping = buf[:2], buf[1:301]  # out would overwrite a scale
    shared_scales.copy_(scales)
    with pytest.raises(RuntimeError, match="out"):
        d(codes, shared_scales, overlapping, 0)
    assert (buf[2:] == 3.0).all() and (shared_scales == 5.0).all()
    assert (out == 3.0).all()


@pytest.mark.parametrize("code", CODES)
def test_opcheck(code):
    x = _inputs(600, code, 1.0, seed=8)
    codes, scales = torch.empty(600, dtype=torch.uint8), torch.empty(3)
    c = CODES.index(code)
    torch.library.opcheck(torch.ops.ruda_torch.quantize_8bit, (x, codes, scales, c))
    ops.quantize_8bit(x, code)
    torch.library.opcheck(
        torch.ops.ruda_torch.dequantize_8bit, (*ops.quantize_8bit(x, code), torch.empty(600), c)
    )


# ---- the 8-bit step: adamw_scaled_ with uint8 moment buffers (Note [8-bit moments]) ----

BLOCK = ops.BLOCK_8BIT
STEP_SIZES = [97, 0, 1025, 256, 4096, 16385, 65537]  # a CPU tile edge (16384) inside


def _bucket_8bit(sizes, amsgrad, param_dtype=torch.float32, seed=0, master=False):
    """Parameters, FP32 gradients, and 8-bit moment buffers of a bucket whose slices start
    blocks; the moments are quantized from random FP32 values."""
    gen = torch.Generator().manual_seed(seed)
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // BLOCK) * BLOCK
    params = [(torch.randn(n, generator=gen)).to(param_dtype) for n in sizes]
    grads = [torch.randn(n, generator=gen) * 1e-2 for n in sizes]
    grads = [g.to(param_dtype) for g in grads] if param_dtype != torch.float32 else grads
    m = torch.randn(total, generator=gen) * 1e-2
    v = torch.rand(total, generator=gen) ** 4 * 1e-4
    vm = v * (1 + torch.rand(total, generator=gen))
    for off, n in zip(offsets, sizes, strict=True):  # padding holds nothing
        end = -(-(off + n) // BLOCK) * BLOCK
        for t in (m, v, vm):
            t[off + n : end] = 0
    state = {
        "exp_avg": ops.pack_8bit(m, "signed"),
        "exp_avg_sq": ops.pack_8bit(v, "unsigned"),
        "max_exp_avg_sq": ops.pack_8bit(vm, "unsigned") if amsgrad else None,
        "steps": torch.arange(len(sizes), dtype=torch.float32) + 3.0,
        "slots": torch.tensor([[off, i] for i, off in enumerate(offsets)]).reshape(-1, 2),
        "master": None,
    }
    if master:
        state["master"] = torch.randn(total, generator=gen)
        for p, off, n in zip(params, offsets, sizes, strict=True):
            state["master"][off : off + n] = p.float()
    return params, grads, state, offsets


MOMENT_CODES = (("exp_avg", "signed"), ("exp_avg_sq", "unsigned"), ("max_exp_avg_sq", "unsigned"))


def _row_bucket(shapes, amsgrad, param_dtype=torch.float32, seed=0, master=False):
    """A bucket as the optimizer lays out tensors of these shapes (Note [8-bit row blocks]
    in csrc/quant8.h): codes one per element from offsets at multiples of 256, the scales
    apart, a run per moment, where a tensor of rows that are not whole blocks has its
    rows' scales after the flat tensors' (slots' columns 2 and 3). Returns (params,
    grads, state, layout), layout[i] = (offset, first scale, row length or 0)."""
    gen = torch.Generator().manual_seed(seed)
    layout, total = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        layout.append([total, 0, shape[1] if shape[0] > 1 and shape[1] % BLOCK else 0])
        total += -(-numel // BLOCK) * BLOCK
    run = total // BLOCK
    for entry, shape in zip(layout, shapes, strict=True):
        off, _, row = entry
        entry[1] = run if row else off // BLOCK
        run += math.prod(ops.scales_shape_8bit(shape)) if row else 0
    params = [torch.randn(math.prod(s), generator=gen).to(param_dtype) for s in shapes]
    grads = [(torch.randn(math.prod(s), generator=gen) * 1e-2).to(
        torch.float32 if param_dtype == torch.float32 else param_dtype) for s in shapes]  # fmt: skip
    keys = MOMENT_CODES[: 3 if amsgrad else 2]
    state = {k: torch.zeros(total, dtype=torch.uint8) for k, _ in keys}
    state["max_exp_avg_sq"] = state.get("max_exp_avg_sq")
    state["scales"] = torch.zeros(len(keys) * run)
    for q, (key, code) in enumerate(keys):
        for (off, first, _), shape in zip(layout, shapes, strict=True):
            x = torch.randn(shape, generator=gen) * 1e-2
            if code == "unsigned":
                x = x.square() * (2 if key == "max_exp_avg_sq" else 1)
            codes, scales = ops.quantize_8bit(x, code)
            state[key][off : off + codes.numel()] = codes.flatten()
            state["scales"][q * run + first : q * run + first + scales.numel()] = scales.flatten()
    state["steps"] = torch.arange(len(shapes), dtype=torch.float32) + 3.0
    state["slots"] = torch.tensor([[off, i, row, first] for i, (off, first, row) in
                                   enumerate(layout)], dtype=torch.int64).reshape(-1, 4)  # fmt: skip
    state["master"] = None
    if master:
        state["master"] = torch.randn(total, generator=gen)
        for p, (off, _, _) in zip(params, layout, strict=True):
            state["master"][off : off + p.numel()] = p.float()
    return params, grads, state, layout


def _row_moments(state, shapes, layout):
    """Each tensor's decoded moments (FP32, shaped), by key."""
    run = state["scales"].numel() // (3 if state["max_exp_avg_sq"] is not None else 2)
    out = {}
    for q, (key, code) in enumerate(MOMENT_CODES):
        if state[key] is None:
            continue
        out[key] = []
        for (off, first, _), shape in zip(layout, shapes, strict=True):
            n, k = math.prod(shape), math.prod(ops.scales_shape_8bit(shape))
            codes = state[key][off : off + n].view(shape)
            scales = state["scales"][q * run + first : q * run + first + k]
            out[key].append(ops.dequantize_8bit(codes, scales.view(ops.scales_shape_8bit(shape)),
                                                code))  # fmt: skip
    return out


def _step(params, grads, state, **kw):
    kw.setdefault("scales", state.get("scales"))
    ops.adamw_scaled_(params, grads, state["exp_avg"], state["exp_avg_sq"],
                      state["max_exp_avg_sq"], state["steps"], state["slots"],
                      lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                      master=state["master"], **kw)  # fmt: skip


def _decoded(state):
    """The same bucket with FP32 moment buffers holding the decoded 8-bit moments."""
    out = dict(state)
    out["exp_avg"] = ops.unpack_8bit(state["exp_avg"], "signed")
    out["exp_avg_sq"] = ops.unpack_8bit(state["exp_avg_sq"], "unsigned")
    if state["max_exp_avg_sq"] is not None:
        out["max_exp_avg_sq"] = ops.unpack_8bit(state["max_exp_avg_sq"], "unsigned")
    out["steps"] = state["steps"].clone()
    out["master"] = None if state["master"] is None else state["master"].clone()
    return out


def _requantized(fp32_state, offsets, sizes, like):
    """fp32_state's moments coded slice by slice (each slice its own blocks), packed as
    `like`'s buffers: what the fused 8-bit step must have written."""
    out = {}
    for key, code in (("exp_avg", "signed"), ("exp_avg_sq", "unsigned"),
                      ("max_exp_avg_sq", "unsigned")):  # fmt: skip
        if like[key] is None:
            continue
        packed = like[key].clone()
        capacity = packed.numel() // (BLOCK + 4) * BLOCK
        scales = packed[capacity:].view(torch.float32)
        for off, n in zip(offsets, sizes, strict=True):
            if n == 0:
                continue
            codes, s = ops.quantize_8bit(fp32_state[key][off : off + n].contiguous(), code)
            packed[off : off + n] = codes
            scales[off // BLOCK : off // BLOCK + s.numel()] = s
        out[key] = packed
    return out


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize(
    "param_dtype,master",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float16, True)],
    ids=["fp32", "bf16", "fp16-master"],
)
def test_8bit_step_is_the_fp32_step_on_decoded_moments(amsgrad, param_dtype, master):
    """One fused pass equals: decode the moments, the FP32 kernel, code the new moments
    with each block's new scale; parameters, masters, codes, scales and counters bit for
    bit, over three steps, with sizes that end mid-block and cross a CPU tile."""
    params, grads, state, offsets = _bucket_8bit(STEP_SIZES, amsgrad, param_dtype, master=master)
    ref_params = [p.clone() for p in params]
    for step in range(3):
        ref = _decoded(state)
        _step(ref_params, grads, ref)
        want = _requantized(ref, offsets, STEP_SIZES, state)
        _step(params, grads, state)
        for p, q in zip(params, ref_params, strict=True):
            assert torch.equal(p.view(torch.int16 if p.element_size() == 2 else torch.int32),
                               q.view(torch.int16 if q.element_size() == 2 else torch.int32))  # fmt: skip
        for key, packed in want.items():
            assert torch.equal(state[key], packed), f"{key} at step {step}"
        assert torch.equal(state["steps"], ref["steps"])
        if master:
            assert torch.equal(state["master"], ref["master"])
        for p, q in zip(params, ref_params, strict=True):  # the next step starts equal
            q.copy_(p)


ROW_SHAPES = [(3, 97), (1, 1025), (4, 300), (2, 256), (17, 33), (0, 40), (9, 500), (70, 130)]


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_8bit_step_in_rows_is_the_fp32_step_on_decoded_rows(amsgrad, param_dtype):
    """Tensors of rows that are not whole blocks (Note [8-bit row blocks] in
    csrc/quant8.h: rows of 97, 300, 33, 500 and 130 elements, their codes one per element,
    their scales apart), beside one row, rows of whole blocks and no rows: one fused pass
    equals the FP32 kernel on the decoded moments, then each tensor coded by its rows
    (ops.quantize_8bit); parameters, codes and scales bit for bit over three steps (a CPU
    tile of 16,384 walk indices ends mid-tensor)."""
    params, grads, state, layout = _row_bucket(ROW_SHAPES, amsgrad, param_dtype, seed=9)
    assert sum(row != 0 for _, _, row in layout) == 5
    ref_params = [p.clone() for p in params]
    for step in range(3):
        moments = _row_moments(state, ROW_SHAPES, layout)
        ref = {k: torch.cat([t.flatten() for t in v]) for k, v in moments.items()}
        ref = {"exp_avg": ref["exp_avg"], "exp_avg_sq": ref["exp_avg_sq"],
               "max_exp_avg_sq": ref.get("max_exp_avg_sq"), "steps": state["steps"].clone(),
               "master": None}  # fmt: skip
        starts = torch.tensor([0] + [p.numel() for p in params]).cumsum(0)[:-1]
        ref["slots"] = torch.stack([starts, torch.arange(len(params))], 1).contiguous()
        _step(ref_params, grads, ref)
        _step(params, grads, state)
        for p, q in zip(params, ref_params, strict=True):
            assert torch.equal(p.view(torch.int16 if p.element_size() == 2 else torch.int32),
                               q.view(torch.int16 if q.element_size() == 2 else torch.int32))  # fmt: skip
        got = _row_moments(state, ROW_SHAPES, layout)
        run = state["scales"].numel() // (3 if amsgrad else 2)
        for q, (key, code) in enumerate(MOMENT_CODES[: 3 if amsgrad else 2]):
            for i, ((off, first, _), shape) in enumerate(zip(layout, ROW_SHAPES, strict=True)):
                n = math.prod(shape)
                start = int(starts[i])
                codes, scales = ops.quantize_8bit(ref[key][start : start + n].view(shape), code)
                assert torch.equal(state[key][off : off + n], codes.flatten()), (key, shape, step)
                mine = state["scales"][q * run + first : q * run + first + scales.numel()]
                assert torch.equal(mine, scales.flatten()), (key, shape, step)
            assert len(got[key]) == len(ROW_SHAPES)
        assert state["steps"].tolist() == [4.0 + step + i for i in range(len(ROW_SHAPES))]
        for p, q in zip(params, ref_params, strict=True):  # the next step starts equal
            q.copy_(p)


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_8bit_step_decodes_every_code_as_the_fp32_step_does(amsgrad):
    """Every block holds each of the 256 codes once (in a random order per block), with
    scales from 2^-60 to 2^10: the step's decoding of every code (subnormal codes, the
    largest ones, signed zero's absence) is the decoding of unpack_8bit, and its coding the
    coding of quantize_8bit, bit for bit (the CPU kernel decodes and codes in vector lanes
    inside its update loop, Note [One pass per 8-bit block] in csrc/cpu/kernels/adamw_cpu.cpp)."""
    sizes = [97, 1025, 4096, 16385]
    params, grads, state, offsets = _bucket_8bit(sizes, amsgrad, seed=7)
    gen = torch.Generator().manual_seed(8)
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        packed = state[key]
        if packed is None:
            continue
        capacity = packed.numel() // (BLOCK + 4) * BLOCK
        blocks = capacity // BLOCK
        perms = torch.stack([torch.randperm(BLOCK, generator=gen) for _ in range(blocks)])
        packed[:capacity] = perms.reshape(-1).to(torch.uint8)
        exponents = torch.randint(-60, 11, (blocks,), generator=gen).float()
        packed[capacity:].view(torch.float32)[:] = torch.rand(blocks, generator=gen).add(1) * (
            2.0**exponents
        )
    ref_params = [p.clone() for p in params]
    ref = _decoded(state)
    _step(ref_params, grads, ref)
    want = _requantized(ref, offsets, sizes, state)
    _step(params, grads, state)
    for p, q in zip(params, ref_params, strict=True):
        assert torch.equal(p.view(torch.int32), q.view(torch.int32))
    for key, packed in want.items():
        assert torch.equal(state[key], packed), key


def test_8bit_step_skipped_writes_nothing():
    params, grads, state, _ = _bucket_8bit([1025, 97], amsgrad=True)
    before = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    p_before = [p.clone() for p in params]
    _step(params, grads, state, found_inf=torch.ones(1))
    for k, v in before.items():
        assert torch.equal(state[k], v), k
    assert all(torch.equal(p, q) for p, q in zip(params, p_before, strict=True))


def test_8bit_row_slots_are_checked():
    """Slots of tensors whose rows are not whole blocks: scales outside each moment's run,
    or shared with another tensor, a row length that does not divide the tensor, rows
    with packed moments: refused, naming the slot, before anything is written."""
    shapes = [(4, 300), (3, 256), (2, 100)]
    cases = {
        "past the run": (lambda st: st["slots"].__setitem__((0, 3), 10**6),
                         r"slots\[0\] puts the 8 scale\(s\) of params\[0\] at 1000000, outside"),
        "shared": (lambda st: st["slots"].__setitem__((2, 3), int(st["slots"][0, 3]) + 1),
                   "two parameters share 8-bit scales"),
        "row not dividing": (lambda st: st["slots"].__setitem__((0, 2), 7),
                             r"slots\[0\] gives params\[0\] rows of 7 elements"),
        "packed": (lambda st: st.__setitem__("scales", None),
                   r"a row length .* is for 8-bit moments \(uint8 exp_avg\) with separate scales"),
    }  # fmt: skip
    for name, (mutate, match) in cases.items():
        params, grads, state, _ = _row_bucket(shapes, False, seed=2)
        if name == "packed":  # packed buffers of the same codes: scales after codes
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.cat([state[key], torch.zeros(4 * state[key].numel() // BLOCK,
                                                                dtype=torch.uint8)])  # fmt: skip
        mutate(state)
        before = [p.clone() for p in params] + [state["exp_avg"].clone()]
        with pytest.raises(RuntimeError, match=match):
            _step(params, grads, state)
        after = [p.clone() for p in params] + [state["exp_avg"].clone()]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), name


def test_8bit_buffers_are_checked():
    params, grads, state, _ = _bucket_8bit([1025, 97], amsgrad=False)
    state["exp_avg"] = state["exp_avg"][:-1]
    with pytest.raises(RuntimeError, match="8-bit moment buffers .* 260 bytes per block"):
        _step(params, grads, state)
    params, grads, state, _ = _bucket_8bit([1025, 97], amsgrad=False)
    state["slots"][1, 0] = 1024 + 16  # inside the first slice's last block, and unaligned
    with pytest.raises(RuntimeError, match="starts a block of 256"):
        _step(params, grads, state)
    params, grads, state, _ = _bucket_8bit([300], amsgrad=False)
    with pytest.raises(RuntimeError, match="exp_avg_sq must be uint8"):
        _step(params, grads, {**state, "exp_avg_sq": torch.zeros(512)})


# Gradients whose moments overflow or underflow FP32 (Note [8-bit moments]): finite, so no
# finite check skips them. 1e19 squares to 1e38 (finite); 1e30, -1e30 and FLT_MAX square to
# inf; 1e-40 is subnormal and squares to 0.
FLT_MAX = torch.finfo(torch.float32).max
EXTREME_GRADS = (1e19, 1e30, -1e30, FLT_MAX, -FLT_MAX, 1e-40)


def _extreme_grads(grads, seed, dtype):
    """grads with extreme values dropped in: single ones in some blocks, a block of nothing
    but overflowing values, and one mixing every kind. Values the dtype cannot hold finite
    are left out (FLT_MAX is not a BF16 value: it rounds to inf)."""
    gen = torch.Generator().manual_seed(seed)
    extremes = [x for x in EXTREME_GRADS if torch.isfinite(torch.tensor(x).to(dtype))]
    out = []
    for g in grads:
        g = g.clone()
        n = g.numel()
        if n >= 2 * BLOCK:
            g[BLOCK : 2 * BLOCK] = extremes[1]  # a block of overflowing values
        for i in range(0, n, 97):  # sprinkled: mixed blocks
            pick = torch.randint(len(extremes), (1,), generator=gen).item()
            g[i] = extremes[pick]
        out.append(g)
    return out


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_8bit_step_with_overflowing_moments_is_the_fp32_step(amsgrad, param_dtype):
    """Gradients of 1e19, +-1e30, +-FLT_MAX and subnormals: the fused 8-bit step is still
    the FP32 step on the decoded moments, bit for bit, and every parameter the FP32 step
    keeps finite stays finite (an infinite second moment is kept in its element, as FP32
    keeps it: its parameter moves by the weight decay only, the rest of the block as
    usual), over three steps (the later ones with ordinary gradients)."""
    sizes = [97, 1025, 4096]
    params, grads, state, offsets = _bucket_8bit(sizes, amsgrad, param_dtype, seed=4)
    ordinary = [g.clone() for g in grads]
    ref_params = [p.clone() for p in params]
    for step in range(3):
        step_grads = _extreme_grads(ordinary, step, param_dtype) if step == 0 else ordinary
        ref = _decoded(state)
        _step(ref_params, step_grads, ref)
        want = _requantized(ref, offsets, sizes, state)
        _step(params, step_grads, state)
        for p, q in zip(params, ref_params, strict=True):
            assert _same_values(p.float(), q.float()), f"parameters at step {step}"
            assert torch.isfinite(p).all(), f"a parameter became non-finite at step {step}"
        for key, packed in want.items():
            assert torch.equal(state[key], packed), f"{key} at step {step}"
        for p, q in zip(params, ref_params, strict=True):
            q.copy_(p)
    v = ops.unpack_8bit(state["exp_avg_sq"], "unsigned")
    assert torch.isinf(v).any() and not torch.isnan(v).any()
