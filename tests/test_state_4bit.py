"""state_precision="4bit": blockwise 4-bit moments (Note [4-bit moments] in csrc/quant4.h,
Note [4-bit buckets] and Note [4-bit state entries] in ruda_torch/_state4bit.py).

The codec is checked against a reference written here from the definition (nearest value
of the code book, ties to the even code; a positive second moment never coded 0; special
blocks), on fresh random inputs over many binades. The oracle of a step is the algorithm
itself: decode every moment, one FP32 fused step of ruda_torch.AdamW (tested against
torch.optim.AdamW elsewhere), code the new moments with ops.quantize_4bit: parameters,
masters, codes, scales and counters must match bit for bit.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from optim_harness import copy_grads
from test_ops import same_bits
from torch import nn

import ruda_torch
from ruda_torch import ops
from ruda_torch._common import codes4_key, codes_key, scales4_key

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
M_VALUES = [0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0, 1.5]  # sign + E2M1 magnitudes
V_VALUES = [f / 16 if e == 0 else 2.0 ** (e - 3) * (1 + f / 4) for e in range(4) for f in range(4)]


# ---------------------------------------------------------------------------- the codec


def _nearest(y: torch.Tensor, table: list[float]) -> torch.Tensor:
    """Index of the nearest table value to each y (>= 0), ties to the even index."""
    t = torch.tensor(table, dtype=torch.float64)
    d = (y.double()[:, None] - t[None, :]).abs()
    best = d.min(1, keepdim=True).values
    candidates = d == best
    even = candidates & (torch.arange(len(table)) % 2 == 0)
    return torch.where(even.any(1), even.float().argmax(1), candidates.float().argmax(1))


def reference_block(x: torch.Tensor, code: str) -> tuple[torch.Tensor, float]:
    """The codes (one per element) and scale of one block, by the definition."""
    signed = code == "signed"
    finite = x[torch.isfinite(x)]
    special = finite.numel() != x.numel()
    largest = finite.abs().max().item() if finite.numel() else 0.0
    scale = largest if largest >= 2.0**-126 else 0.0
    if special:
        top = 1.0 if signed else 1.25
    else:
        top = 1.5 if signed else 1.75
    inverse = torch.tensor(top, dtype=torch.float32) / scale if scale > 0 else torch.tensor(0.0)
    y = (x.abs() * inverse.float()).float()
    table = M_VALUES if signed else V_VALUES
    codes = _nearest(torch.where(torch.isfinite(y), y, torch.zeros_like(y)), table)
    if signed:
        codes = codes | ((x < 0) & (codes != 0)).long() << 3
    else:
        codes = torch.where((codes == 0) & (y > 0), torch.ones_like(codes), codes)
    if special:
        nan, inf = (8, 7) if signed else (14, 15)
        codes = torch.where(torch.isnan(x), torch.full_like(codes, nan), codes)
        inf_codes = torch.full_like(codes, inf) | ((x < 0).long() << 3 if signed else 0)
        codes = torch.where(torch.isinf(x), inf_codes, codes)
        scale = -scale  # the sign bit marks the block (-0.0 for a zero finite part)
        if scale == 0:
            scale = -0.0
    return codes, scale


def reference_quantize(x: torch.Tensor, code: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.quantize_4bit by the definition: blocks of 128 of each row."""
    rows = x.shape[0] if x.dim() >= 2 else 1
    flat = x.reshape(rows, -1)
    per_row = -(-flat.shape[1] // 128)
    codes = torch.zeros_like(flat, dtype=torch.long)
    scales = torch.zeros(rows, per_row)
    for r in range(rows):
        for b in range(per_row):
            c, s = reference_block(flat[r, 128 * b : 128 * (b + 1)], code)
            codes[r, 128 * b : 128 * (b + 1)] = c
            scales[r, b] = s
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed.reshape(ops.codes_shape_4bit(x.shape)), scales.reshape(
        ops.scales_shape_4bit(x.shape)
    )


def reference_dequantize(codes: torch.Tensor, scales: torch.Tensor, code: str) -> torch.Tensor:
    signed = code == "signed"
    shape = ops.shape_of_codes_4bit(codes.shape)
    rows = shape[0] if len(shape) >= 2 else 1
    c = codes.reshape(rows, -1).long()
    nib = torch.stack([c & 15, c >> 4], -1).reshape(rows, -1)
    s = scales.reshape(rows, -1)
    block = torch.arange(nib.shape[1]) // 128
    scale = s[:, block]
    special = torch.signbit(scale)
    top = torch.where(special, 1.0 if signed else 1.25, 1.5 if signed else 1.75).float()
    table = torch.tensor(M_VALUES if signed else V_VALUES, dtype=torch.float32)
    if signed:
        value = table[nib & 7] * torch.where(nib >= 8, -1.0, 1.0)
    else:
        value = table[nib]
    # The code's ratio to the top (an FP32 quotient: 1 for the top code) times the scale.
    out = (value / top) * scale.abs()
    nan = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)  # the kernels' NaN
    if signed:
        out = torch.where(
            special & ((nib & 7) == 7), torch.where(nib >= 8, -1.0, 1.0) * float("inf"), out
        )
        out = torch.where(special & (nib == 8), nan, out)
    else:
        out = torch.where(special & (nib == 15), float("inf"), out)
        out = torch.where(special & (nib == 14), nan, out)
    return out.reshape(shape)


def _moment(shape, code: str, seed: int) -> torch.Tensor:
    """Values over many binades (blocks of unequal scales), ties and exact code values."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).pow(8) * 10
    flat = x.view(-1)
    # Exact midpoints between codes and code values, scaled by the block's largest.
    if flat.numel() >= 128:
        flat[0] = 1.5
        flat[1:9] = torch.tensor([0.0625, 0.1875, 0.3125, 0.625, 0.875, 1.25, 0.1, 1e-9])
    return x.abs() if code == "unsigned" else x


SHAPES = [(2,), (98,), (1026,), (65538,), (3, 98), (5, 130), (4, 256), (2, 3, 66), (7, 1030)]


@pytest.mark.parametrize("code", ["signed", "unsigned"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_codec_matches_the_definition(shape, code):
    x = _moment(shape, code, seed=len(shape) * 100 + shape[-1])
    codes, scales = ops.quantize_4bit(x, code)
    want_codes, want_scales = reference_quantize(x, code)
    assert codes.shape == want_codes.shape and scales.shape == want_scales.shape
    assert same_bits(scales, want_scales)
    assert torch.equal(codes, want_codes)
    back = ops.dequantize_4bit(codes, scales, code)
    assert same_bits(back, reference_dequantize(codes, scales, code))
    # The error bound of the code book: half its largest gap (1/2 of 1.5 for the signed
    # code, 1/4 of 1.75 for the unsigned) in units of the block's largest magnitude.
    rows = x.shape[0] if x.dim() >= 2 else 1
    err = (back - x).abs().reshape(rows, -1)
    scale = scales.reshape(rows, -1)[:, torch.arange(err.shape[1]) // 128]
    bound = 1 / 6 if code == "signed" else 1 / 14
    assert (err <= scale * bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("code", ["signed", "unsigned"])
def test_decoded_values_code_back_to_the_same_codes_and_scales(code):
    """Decoding then coding again is the identity on codes and scales (Note [4-bit moments]:
    a block's largest decodes to its scale), blocks with non-finite values too: what makes
    FSDP1's FP32 state dicts and dequantize_state_dict round-trip bit for bit."""
    x = _moment((7, 1030), code, seed=3)
    x[2, 5], x[4, 700] = float("inf"), float("nan")
    x[5, 130:258] = 0.0  # a block of zeros
    codes, scales = ops.quantize_4bit(x, code)
    codes2, scales2 = ops.quantize_4bit(ops.dequantize_4bit(codes, scales, code), code)
    assert torch.equal(codes2, codes)
    assert same_bits(scales2, scales)
    assert (scales < 0).sum() == 2  # not vacuous: the special blocks went through


def test_a_positive_second_moment_never_decodes_to_zero():
    v = torch.rand(4, 256) * 1e-3
    v[:, 0] = 1.0  # each row's blocks: one large value beside tiny ones
    v[:, 128] = 1.0
    v[1, 5] = 0.0
    codes, scales = ops.quantize_4bit(v, "unsigned")
    back = ops.dequantize_4bit(codes, scales, "unsigned")
    assert (back[v > 0] > 0).all()
    assert back[1, 5] == 0  # an exact zero stays zero
    assert (back >= v * 0.5).all()  # never far below: the step never grows much


def test_non_finite_values_keep_their_element():
    x = torch.randn(2, 256)
    x[0, 3], x[0, 200], x[1, 7] = float("inf"), float("-inf"), float("nan")
    for code in ("signed", "unsigned"):
        v = x if code == "signed" else x.abs()
        codes, scales = ops.quantize_4bit(v, code)
        back = ops.dequantize_4bit(codes, scales, code)
        assert torch.isinf(back[0, 3]) and back[0, 3] > 0
        assert torch.isinf(back[0, 200]) and (back[0, 200] < 0) == (code == "signed")
        assert torch.isnan(back[1, 7])
        finite = torch.isfinite(v)
        assert torch.isfinite(back[finite]).all()
        assert same_bits(back, reference_dequantize(codes, scales, code))
        assert torch.equal(codes, reference_quantize(v, code)[0])
        assert torch.signbit(scales).tolist() == [[True, True], [True, False]]


def test_codec_refuses_what_it_cannot_pair():
    with pytest.raises(ValueError, match="last dimension, which must be even"):
        ops.quantize_4bit(torch.randn(3, 5), "signed")
    with pytest.raises(ValueError, match="code must be 'signed'"):
        ops.quantize_4bit(torch.randn(4), "bits")
    codes, scales = ops.quantize_4bit(torch.randn(3, 200), "signed")
    with pytest.raises(ValueError, match=r"shape \(3, 2\)"):
        ops.dequantize_4bit(codes, scales.reshape(-1), "signed")


def test_zero_size_and_all_zero_blocks():
    codes, scales = ops.quantize_4bit(torch.zeros(0, 4), "signed")
    assert codes.shape == (0, 2) and scales.shape == (0, 1)
    codes, scales = ops.quantize_4bit(torch.zeros(300), "unsigned")
    assert (scales == 0).all() and (codes == 0).all()
    tiny = torch.full((128,), 1e-39)  # below FP32's smallest normal: stored as zeros
    codes, scales = ops.quantize_4bit(tiny, "unsigned")
    assert scales.item() == 0


# ---------------------------------------------------------------------------- the step


class _Net(nn.Module):
    """Parameters of every kind a 4-bit group holds: (130, 66) 4-bit (rows of 66: one short
    block each, laid out in rows); (20, 130) 4-bit (rows of a block and a bit); (33, 129),
    last dimension odd: 8-bit; the biases below min_8bit_size: FP32."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(66, 130).to(dtype)
        self.b = nn.Linear(130, 20).to(dtype)
        self.c = nn.Parameter((torch.randn(33, 129) / 9).to(dtype))

    def forward(self, x):
        h = torch.tanh(self.a(x.to(self.a.weight.dtype)))
        y = self.b(h).float().pow(2).mean()
        return y + (h[:, :33] @ self.c).float().pow(2).mean()


def _backward(model, s: int) -> None:
    model(torch.randn(16, 66, generator=torch.Generator().manual_seed(s))).backward()


def _make(model, **kw):
    kw = {"lr": 1e-2, "fused_step": True, "state_precision": "4bit", "min_8bit_size": 1000, **kw}
    return ruda_torch.AdamW(model.parameters(), **kw)


def _with_precision(state_dict: dict, precision: str) -> dict:
    """A state dict whose groups ask for ``precision`` (load_state_dict takes the groups'
    options with the state, as torch's does)."""
    groups = [{**g, "state_precision": precision} for g in state_dict["param_groups"]]
    return {**state_dict, "param_groups": groups}


def _as_fp32(state_dict: dict) -> dict:
    """A state dict with every moment decoded and its groups' options set to FP32 moments
    (load_state_dict takes the groups' options with the state, as torch's does)."""
    sd = ruda_torch.dequantize_state_dict(state_dict)
    return {**sd, "param_groups": [{**g, "state_precision": "fp32"} for g in sd["param_groups"]]}


def _decoded(entry: dict) -> dict:
    """An entry's moments as FP32 values (any form)."""
    return ruda_torch.dequantize_state_dict({"state": {0: entry}, "param_groups": []})["state"][0]


def test_parameters_take_the_format_their_shape_allows():
    model = _Net()
    opt = _make(model)
    _backward(model, 0)
    opt.step()
    assert set(opt.state[model.a.weight]) == {"step", "exp_avg_codes4", "exp_avg_scales4",
                                             "exp_avg_sq_codes4", "exp_avg_sq_scales4"}  # fmt: skip
    assert opt.state[model.a.weight]["exp_avg_codes4"].shape == (130, 33)
    assert opt.state[model.b.weight]["exp_avg_scales4"].shape == (20, 2)
    assert codes_key("exp_avg") in opt.state[model.c]  # odd last dimension: 8 bits
    assert "exp_avg" in opt.state[model.a.bias]  # below min_8bit_size: FP32


@pytest.mark.parametrize(
    "dtype, options",
    [
        (torch.float32, {}),
        (torch.float32, {"amsgrad": True, "weight_decay": 0.1}),
        (torch.float32, {"maximize": True, "weight_decay": 0.3}),
        (torch.bfloat16, {"master_weights": "remainder"}),
        (torch.bfloat16, {"master_weights": True, "amsgrad": True}),
        (torch.float16, {"master_weights": True}),
    ],
    ids=["fp32", "amsgrad-wd", "maximize-wd", "bf16-remainder", "bf16-master-ams", "fp16-master"],
)
def test_a_step_is_decode_the_fp32_step_encode(dtype, options):
    model = _Net(dtype)
    opt = _make(model, **options)
    twin_model = copy.deepcopy(model)
    twin = ruda_torch.AdamW(twin_model.parameters(), lr=1e-2, fused_step=True, **options)
    for s in range(4):
        opt.zero_grad()
        _backward(model, s)
        if s:
            # The twin starts from this optimizer's state, decoded (its masters and
            # counters too): its FP32 step is the oracle of this one.
            twin.load_state_dict(_as_fp32(opt.state_dict()))
            for p, q in zip(model.parameters(), twin_model.parameters(), strict=True):
                q.data.copy_(p.data)
        copy_grads(model, twin_model)
        opt.step()
        twin.step()
        for (name, p), q in zip(model.named_parameters(), twin_model.parameters(), strict=True):
            assert same_bits(p, q), f"step {s}: {name}"
            mine, theirs = opt.state[p], twin.state[q]
            for key in MOMENTS:
                if codes4_key(key) in mine:
                    code = "signed" if key == "exp_avg" else "unsigned"
                    codes, scales = ops.quantize_4bit(theirs[key], code)
                    assert torch.equal(mine[codes4_key(key)], codes), f"step {s}: {name} {key}"
                    assert same_bits(mine[scales4_key(key)], scales), f"step {s}: {name} {key}"
            for key in ("step", "master_param", "master_remainder"):
                if key in theirs:
                    assert same_bits(mine[key], theirs[key]), f"step {s}: {name} {key}"


def test_an_overflowing_square_moves_that_element_by_zero_as_fp32_does():
    model = nn.Linear(256, 64, bias=False)
    opt = ruda_torch.AdamW(model.parameters(), lr=1e-2, fused_step=True, state_precision="4bit",
                           min_8bit_size=0)  # fmt: skip
    twin = copy.deepcopy(model)
    topt = ruda_torch.AdamW(twin.parameters(), lr=1e-2, fused_step=True)
    g = torch.randn(64, 256)
    g[3, 10] = 1e30  # finite; its square overflows to inf
    for m, o in ((model, opt), (twin, topt)):
        m.weight.grad = g.clone()
        o.step()
    assert same_bits(model.weight, twin.weight)
    v = _decoded(opt.state[model.weight])["exp_avg_sq"]
    assert torch.isinf(v[3, 10]) and torch.isfinite(v[torch.arange(64) != 3]).all()
    # The next step of both from the same decoded state: the same bits again.
    topt.load_state_dict(_as_fp32(opt.state_dict()))
    for m, o in ((model, opt), (twin, topt)):
        m.weight.grad = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
        o.step()
    assert same_bits(model.weight, twin.weight)


def _train(model, opt, steps, first=0):
    for s in range(first, first + steps):
        opt.zero_grad()
        _backward(model, s)
        opt.step()


def test_checkpoint_resumes_bit_for_bit():
    model = _Net()
    opt = _make(model, amsgrad=True)
    _train(model, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    _train(model, opt, 2, first=3)
    buf.seek(0)
    saved = torch.load(buf)
    resumed = _Net()
    resumed.load_state_dict(saved["model"])
    ropt = _make(resumed, amsgrad=True)
    ropt.load_state_dict(saved["optim"])
    _train(resumed, ropt, 2, first=3)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert same_bits(p, q)
        for key, value in opt.state[p].items():
            assert same_bits(ropt.state[q][key], value), key


@pytest.mark.parametrize("other", ["fp32", "bf16", "8bit"])
def test_checkpoints_of_every_precision_load_both_ways(other):
    model = _Net()
    opt = _make(model)
    _train(model, opt, 2)
    # 4-bit -> other: the moments as the decoded 4-bit values (rounded for bf16/8-bit).
    into = _make(copy.deepcopy(model), state_precision=other)
    into.load_state_dict(_with_precision(opt.state_dict(), other))
    for p, q in zip(model.parameters(), into.param_groups[0]["params"], strict=True):
        want, got = _decoded(opt.state[p]), _decoded(into.state[q])
        for key in ("exp_avg", "exp_avg_sq"):
            if other == "fp32":
                assert same_bits(got[key], want[key])
            else:
                assert torch.allclose(got[key].float(), want[key], rtol=0.07, atol=1e-12)
    # other -> 4-bit: the other's moments quantized.
    back_model = copy.deepcopy(model)
    back = _make(back_model)
    back.load_state_dict(_with_precision(into.state_dict(), "4bit"))
    for q, r in zip(into.param_groups[0]["params"], back.param_groups[0]["params"], strict=True):
        src, dst = _decoded(into.state[q]), back.state[r]
        for key in ("exp_avg", "exp_avg_sq"):
            if codes4_key(key) in dst:
                code = "signed" if key == "exp_avg" else "unsigned"
                codes, scales = ops.quantize_4bit(src[key].float(), code)
                assert torch.equal(dst[codes4_key(key)], codes)
                assert same_bits(dst[scales4_key(key)], scales)
    # Steps go on from the loaded state.
    _train(back_model, back, 2, first=2)
    assert all(torch.isfinite(p).all() for p in back_model.parameters())


def test_torch_adamw_loads_the_dequantized_state():
    model = _Net()
    opt = _make(model, amsgrad=True)
    _train(model, opt, 2)
    sd = opt.state_dict()
    twin = copy.deepcopy(model)
    topt = torch.optim.AdamW(twin.parameters(), lr=1e-2, amsgrad=True)
    with pytest.raises(KeyError):  # codes under their own names never step as values
        topt.load_state_dict(sd)
        _backward(twin, 5)
        topt.step()
    topt = torch.optim.AdamW(twin.parameters(), lr=1e-2, amsgrad=True)
    topt.load_state_dict(ruda_torch.dequantize_state_dict(sd))
    _backward(twin, 5)
    topt.step()
    assert all(torch.isfinite(p).all() for p in twin.parameters())


def test_bad_entries_are_refused_before_any_write():
    model = _Net()
    opt = _make(model)
    _train(model, opt, 1)
    sd = opt.state_dict()  # entry 1: a.weight (the module's own parameter c comes first)
    before = {k: v.clone() for k, v in opt.state[model.a.weight].items()}
    spoiled = copy.deepcopy(sd)
    spoiled["state"][1]["exp_avg_scales4"] = spoiled["state"][1]["exp_avg_scales4"].reshape(-1)
    with pytest.raises(ValueError, match=r"exp_avg_scales4.*has shape \(130,\).*\(130, 1\)"):
        opt.load_state_dict(spoiled)
    spoiled = copy.deepcopy(sd)
    spoiled["state"][1]["exp_avg"] = torch.zeros(130, 66)
    with pytest.raises(ValueError, match="holds both 'exp_avg' and its 4-bit form"):
        opt.load_state_dict(spoiled)
    spoiled = copy.deepcopy(sd)
    spoiled["state"][1]["exp_avg_codes4"] = spoiled["state"][1]["exp_avg_codes4"].to(torch.int8)
    with pytest.raises(ValueError, match="must be uint8"):
        opt.load_state_dict(spoiled)
    for k, v in before.items():
        assert same_bits(opt.state[model.a.weight][k], v), k


def test_memory_is_about_one_byte_per_element_for_both_moments():
    model = nn.Linear(4096, 1024, bias=False)
    opt = ruda_torch.AdamW(model.parameters(), fused_step=True, state_precision="4bit")
    model.weight.grad = torch.randn_like(model.weight)
    opt.step()
    st = opt.state[model.weight]
    n = model.weight.numel()
    moment_bytes = sum(v.numel() * v.element_size() for k, v in st.items() if k != "step")
    assert moment_bytes / n == pytest.approx(1.0625)
