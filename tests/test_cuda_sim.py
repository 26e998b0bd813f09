"""The CUDA kernels, executed on the emulated device (Note [CUDA emulation] in
csrc/cuda_sim/cuda_sim.h), against the CPU kernels: the same inputs through both, equal
bits required (parameters, moments, AMSGrad maxima, masters, step counters, statistics
rows, merged reports). Every variant the CUDA code has: parameter dtypes FP32, FP64,
FP16, BF16 with their gradient dtypes, AMSGrad, master weights, stochastic rounding,
Adam's L2 decay, skipped steps, the wide-access and the scalar (unaligned) paths, sizes
0, 1, 3, 97, 1025, a tile boundary, 65537 in one bucket with empty tensors between, a slice
past 2^31 elements (a fake base, nothing that large allocated), statistics of every
gradient dtype with non-finite values, merges past one chunk, 8-bit and 4-bit moments
(direct and edge kernels, rows that are not whole blocks, the codecs), a flat-gradient bucket's
device tables through changing subsets; each under both serial
schedules (threads and blocks first to last, and last to first) and the concurrent one.
Built by tests/cuda_sim/build.py, run by `make test-cuda-sim` (also under
AddressSanitizer); needs neither a GPU nor a CUDA toolkit.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from ruda_torch import ops

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ["forward", "reverse", "concurrent"]
SIZES = [0, 1, 3, 0, 97, 1025, 4096, 4097, 0, 65537]  # empty tensors between, a tile edge
# What each __global__ kernel of csrc/cuda is run by here (test_every_kernel_is_emulated).
COVERED = {
    "advance_steps_kernel": "test_update_matches_cpu",
    "adamw_kernel": "test_update_matches_cpu",
    "analyze_kernel": "test_analyze_matches_cpu",
    "merge_kernel": "test_merge_matches_cpu",
    "merge_chunks_kernel": "test_merge_chunks_matches_cpu",
    "adamw8_kernel": "test_update_8bit_matches_cpu",
    "adamw8_rows_kernel": "test_update_8bit_in_rows_matches_cpu",
    "adamw8_edge_kernel": "test_update_8bit_matches_cpu",
    "quantize8_kernel": "test_quantize_8bit_matches_cpu",
    "dequantize8_kernel": "test_quantize_8bit_matches_cpu",
    "adamw4_kernel": "test_update_4bit_matches_cpu",
    "adamw4_rows_kernel": "test_update_4bit_matches_cpu",
    "adamw4_edge_kernel": "test_update_4bit_matches_cpu",
    "quantize4_kernel": "test_quantize_4bit_matches_cpu",
    "dequantize4_kernel": "test_quantize_4bit_matches_cpu",
}


@pytest.fixture(scope="module")
def sim():
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "cuda_sim"))
    from build import load

    return load()


@pytest.fixture(params=SCHEDULES)
def schedule(request, sim):
    sim.set_schedule(request.param)
    yield request.param
    sim.set_schedule("forward")


def _bits(t: torch.Tensor) -> torch.Tensor:
    view = {torch.float32: torch.int32, torch.float64: torch.int64,
            torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.int16: torch.int16, torch.uint8: torch.uint8,
            torch.int8: torch.int8}  # fmt: skip
    return t.contiguous().view(view[t.dtype])


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    diff = (_bits(a) != _bits(b)).reshape(-1).nonzero()
    assert diff.numel() == 0, (
        f"{what}: {diff.numel()} elements differ, first at {diff[0].item()}: emulated CUDA "
        f"{a.reshape(-1)[diff[0]].item()!r} vs CPU {b.reshape(-1)[diff[0]].item()!r}"
    )


# ------------------------------------------------------------------ the update


def _bucket(pdtype, gdtype, amsgrad, master, sizes, unaligned, seed, sdtype=None):
    """Parameters (one of them a view at an odd offset, not 16-byte aligned, when
    ``unaligned``), gradients with a non-finite-free spread of magnitudes, flat state with
    16-element aligned slices (BF16 moments with ``sdtype``), step counters with different
    values."""
    gen = torch.Generator().manual_seed(seed)
    if sdtype is None:
        sdtype = torch.float64 if pdtype == torch.float64 else torch.float32
    params, grads, slots, offset = [], [], [], 0
    for i, n in enumerate(sizes):
        base = torch.randn(n + 1, generator=gen, dtype=torch.float64)
        p = (base[1:] if unaligned and i % 2 else base[:n]).to(pdtype)
        if unaligned and i % 2:
            p = torch.empty(n + 1, dtype=pdtype)[1:].copy_(base[1:])  # odd element offset
        params.append(p)
        grads.append((torch.randn(n, generator=gen, dtype=torch.float64) * 3).to(gdtype))
        slots.append([offset, i])
        offset += -(-n // 16) * 16
    total = max(offset, 1)
    exp_avg = (torch.randn(total, generator=gen, dtype=torch.float64) * 0.1).to(sdtype)
    exp_avg_sq = torch.rand(total, generator=gen, dtype=torch.float64).to(sdtype) * 0.01
    vmax = exp_avg_sq + 0.003 if amsgrad else None
    steps = torch.arange(len(sizes), dtype=torch.float32) * 3
    m = None
    if master:
        m = torch.randn(total, generator=gen)
        for p, (off, _) in zip(params, slots, strict=True):
            m[off : off + p.numel()] = p.float()  # masters the parameters were rounded from
            m[off : off + p.numel() : 3] += 1e-3  # and some written since (the param wins)
    return dict(params=params, grads=grads, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                max_exp_avg_sq=vmax, steps=steps,
                slots=torch.tensor(slots, dtype=torch.int64).reshape(-1, 2), master=m)  # fmt: skip


def _clone(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, list):
            out[k] = [t.clone() if k == "params" else t for t in v]
        elif isinstance(v, torch.Tensor):
            out[k] = v.clone()
        else:
            out[k] = v
    for i, p in enumerate(state["params"]):  # keep the odd offsets of unaligned views
        if p.storage_offset() % 2:
            q = torch.empty(p.numel() + 1, dtype=p.dtype)[1:].view(p.shape)
            out["params"][i] = q.copy_(p)
    return out


def _run_both(sim, state, *, stats=None, found_inf=None, grad_scale=None, clip_coef=None,
              max_grad_norm=0.0, lr=1e-2, wd=0.1, maximize=False, rounding=0, seed=0,
              decoupled=True, lr_tensor=None):  # fmt: skip
    cpu, emu = _clone(state), _clone(state)
    common = dict(lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=wd, maximize=maximize,
                  grad_scale=grad_scale, found_inf=found_inf, stats=stats,
                  max_grad_norm=max_grad_norm, clip_coef=clip_coef)  # fmt: skip
    ops.adamw_scaled_(cpu["params"], cpu["grads"], cpu["exp_avg"], cpu["exp_avg_sq"],
                      cpu["max_exp_avg_sq"], cpu["steps"], cpu["slots"], **common,
                      master=cpu["master"], lr_tensor=lr_tensor,
                      stochastic_rounding=bool(rounding & 1), seed=seed, decoupled=decoupled,
                      state_rounding="stochastic" if rounding & 2 else "nearest",
                      scales=cpu.get("scales"))  # fmt: skip
    sim.adamw(emu["params"], emu["grads"], emu["exp_avg"], emu["exp_avg_sq"],
              emu["max_exp_avg_sq"], emu["steps"], emu["slots"], grad_scale, found_inf, stats,
              clip_coef, 0.0 if lr_tensor is not None else lr, 0.9, 0.99, 1e-8, wd,
              max_grad_norm, maximize, emu["master"], lr_tensor, rounding, ops._seed64(seed),
              decoupled, emu.get("scales"))  # fmt: skip
    return cpu, emu


def _compare(cpu, emu, what):
    for i, (a, b) in enumerate(zip(emu["params"], cpu["params"], strict=True)):
        _same(a, b, f"{what}: params[{i}]")
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master", "scales"):
        if cpu.get(key) is not None:
            _same(emu[key], cpu[key], f"{what}: {key}")
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "steps", "master"):
        if cpu[key] is not None:
            _same(emu[key], cpu[key], f"{what}: {key}")


BF16 = torch.bfloat16
VARIANTS = [
    # (parameter dtype, gradient dtype, amsgrad, master, rounding, decoupled[, moments]):
    # rounding bit 0 stochastic rounding of the parameters, bit 1 of BF16 moments (Note
    # [Low-precision states] in csrc/adamw_math.h)
    (torch.float32, torch.float32, False, False, 0, True),
    (torch.float32, torch.float32, True, False, 0, False),
    (torch.float32, torch.float16, False, False, 0, True),
    (torch.float32, torch.bfloat16, True, False, 0, True),
    (torch.float64, torch.float64, False, False, 0, True),
    (torch.float64, torch.float64, True, False, 0, False),
    (torch.float16, torch.float16, False, False, 0, True),
    (torch.float16, torch.float32, True, True, 0, True),
    (torch.float16, torch.float16, False, True, 0, False),
    (torch.bfloat16, torch.bfloat16, False, False, 0, True),
    (torch.bfloat16, torch.bfloat16, True, False, 1, True),
    (torch.bfloat16, torch.float32, False, True, 0, False),
    (torch.bfloat16, torch.bfloat16, False, False, 1, False),
    (torch.float32, torch.float32, True, False, 2, True, BF16),
    (torch.float32, torch.bfloat16, False, False, 0, True, BF16),
    (torch.bfloat16, torch.bfloat16, True, False, 3, False, BF16),
    (torch.float16, torch.float16, False, True, 2, True, BF16),
]


def _vid(v) -> str:
    p, g, ams, master, sr, dec = v[:6]
    name = f"{str(p)[6:]}-{str(g)[6:]}"
    return name + "".join(s for s, on in ((("-amsgrad"), ams), ("-master", master),
                                          ("-stochastic", sr & 1), ("-l2", not dec),
                                          ("-bf16-moments", len(v) > 6),
                                          ("-stochastic-moments", sr & 2)) if on)  # fmt: skip


@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("variant", VARIANTS, ids=[_vid(v) for v in VARIANTS])
def test_update_matches_cpu(sim, schedule, variant, unaligned):
    pdtype, gdtype, amsgrad, master, rounding, decoupled = variant[:6]
    sdtype = variant[6] if len(variant) > 6 else None
    state = _bucket(pdtype, gdtype, amsgrad, master, SIZES, unaligned, seed=7, sdtype=sdtype)
    cpu, emu = _run_both(sim, state, rounding=rounding, seed=2**63 + 5, decoupled=decoupled,
                         maximize=amsgrad, grad_scale=torch.tensor([2.0]),
                         clip_coef=torch.tensor([0.75]))  # fmt: skip
    _compare(cpu, emu, _vid(variant))
    assert cpu["steps"].tolist() == (torch.arange(len(SIZES)) * 3 + 1).float().tolist()


@pytest.mark.parametrize("views", ["aligned", "unaligned"])
@pytest.mark.parametrize("layout", ["packed", "scales-apart"])
@pytest.mark.parametrize(
    "pdtype,amsgrad,master,rounding",
    [(torch.float32, False, False, 0), (torch.float32, True, False, 0),
     (torch.bfloat16, True, False, 1), (torch.float16, False, True, 0),
     (torch.bfloat16, False, True, 0), (torch.float16, True, False, 0)],
    ids=["fp32", "fp32-amsgrad", "bf16-amsgrad-stochastic", "fp16-master", "bf16-master",
         "fp16-amsgrad"],
)  # fmt: skip
def test_update_8bit_matches_cpu(sim, schedule, pdtype, amsgrad, master, rounding, layout,
                                 views):  # fmt: skip
    """8-bit moments (Note [8-bit moments] in csrc/quant8.h): the emulated kernels (a warp per
    block of 256, lane l its elements 8 l .. 8 l + 7, the new scale reduced by shuffles;
    the blocks not accessed directly, a tensor's shorter last block and every block of a
    view that is not 16-byte aligned, in a launch of their own through shared memory) write
    the CPU kernel's parameters, masters, codes, scales and counters, with sizes that end
    mid-block and whole ones; with the scales in each moment buffer (packed) or in a buffer
    of their own (the optimizer's buckets)."""
    from test_quant8 import _bucket_8bit

    sizes = [97, 0, 1025, 256, 4097, 8192]  # 4097: past a CUDA tile (4096)
    params, grads, state, _ = _bucket_8bit(sizes, amsgrad, pdtype, seed=3, master=master)
    if views == "unaligned":  # odd element offsets: not 16-byte aligned
        params = [torch.empty(p.numel() + 1, dtype=p.dtype)[1:].copy_(p) if i % 2 else p
                  for i, p in enumerate(params)]  # fmt: skip
        grads = [torch.empty(g.numel() + 1, dtype=g.dtype)[1:].copy_(g) if i % 3 == 2 else g
                 for i, g in enumerate(grads)]  # fmt: skip
    state = dict(state, params=params, grads=grads)
    if layout == "scales-apart":
        keys = [k for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if state[k] is not None]
        capacity = state["exp_avg"].numel() // (ops.BLOCK_8BIT + 4) * ops.BLOCK_8BIT
        state["scales"] = torch.cat([state[k][capacity:].view(torch.float32) for k in keys])
        for k in keys:
            state[k] = state[k][:capacity].clone()
    cpu, emu = _run_both(sim, state, rounding=rounding, seed=11, grad_scale=torch.tensor([2.0]),
                         clip_coef=torch.tensor([0.75]))  # fmt: skip
    _compare(cpu, emu, f"8-bit {pdtype}")
    assert not torch.equal(cpu["exp_avg"], state["exp_avg"])  # the step wrote codes


@pytest.mark.parametrize("views", ["aligned", "unaligned"])
@pytest.mark.parametrize(
    "pdtype,amsgrad,master,rounding",
    [(torch.float32, True, False, 0), (torch.bfloat16, False, False, 1),
     (torch.float16, True, True, 0)],
    ids=["fp32-amsgrad", "bf16-stochastic", "fp16-amsgrad-master"],
)  # fmt: skip
def test_update_8bit_in_rows_matches_cpu(sim, schedule, pdtype, amsgrad, master, rounding, views):
    """Tensors whose rows are not whole blocks (Note [8-bit row blocks] in csrc/quant8.h),
    which the edge kernel steps block by block, each block mapped to its row's elements and
    its scale apart; beside them a row of one tensor and rows of whole blocks (the direct
    kernel): the CPU kernel's parameters, masters, codes, scales and counters, bit for
    bit."""
    from test_quant8 import ROW_SHAPES, _row_bucket

    params, grads, state, layout = _row_bucket(ROW_SHAPES, amsgrad, pdtype, seed=13,
                                               master=master)  # fmt: skip
    if views == "unaligned":  # odd element offsets: not 16-byte aligned
        params = [torch.empty(p.numel() + 1, dtype=p.dtype)[1:].copy_(p) if i % 2 else p
                  for i, p in enumerate(params)]  # fmt: skip
    state = dict(state, params=params, grads=grads)
    assert sum(row != 0 for _, _, row in layout) == 5  # rows of 97, 300, 33, 500, 130
    cpu, emu = _run_both(sim, state, rounding=rounding, seed=17, grad_scale=torch.tensor([2.0]))
    _compare(cpu, emu, f"8-bit rows {pdtype}")
    assert not torch.equal(cpu["exp_avg"], state["exp_avg"])  # the step wrote codes


def _with_remainders(state: dict) -> dict:
    """The state with its FP32 masters as the int16 remainders over its BF16 parameters
    (Note [Remainder master] in csrc/adamw_math.h)."""
    from ruda_torch._remainder import remainder_of_master

    rem = torch.zeros(state["master"].numel(), dtype=torch.int16)
    for p, (off, *_rest) in zip(state["params"], state["slots"].tolist(), strict=True):
        rem[off : off + p.numel()] = remainder_of_master(
            p.reshape(-1), state["master"][off : off + p.numel()]
        )
    return dict(state, master=rem)


@pytest.mark.parametrize("views", ["aligned", "unaligned"])
@pytest.mark.parametrize("moments", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_update_remainder_matches_cpu(sim, schedule, moments, amsgrad, views):
    """master_weights="remainder": the emulated kernels (wide accesses, element loops, the
    8-bit direct and edge kernels) write the CPU kernel's parameters and remainders."""
    from test_quant8 import _bucket_8bit

    if moments == "8bit":
        sizes = [97, 0, 1025, 256, 4097, 8192]
        params, grads, state, _ = _bucket_8bit(sizes, amsgrad, torch.bfloat16, seed=4,
                                               master=True)  # fmt: skip
        if views == "unaligned":
            params = [torch.empty(p.numel() + 1, dtype=p.dtype)[1:].copy_(p) if i % 2 else p
                      for i, p in enumerate(params)]  # fmt: skip
        state = dict(state, params=params, grads=grads)
    else:
        state = _bucket(torch.bfloat16, torch.bfloat16, amsgrad, True, SIZES, views == "unaligned",
                        seed=8, sdtype=torch.bfloat16 if moments == "bf16" else None)  # fmt: skip
    state = _with_remainders(state)
    cpu, emu = _run_both(sim, state, grad_scale=torch.tensor([2.0]), clip_coef=torch.tensor([0.75]),
                         rounding=2 if moments == "bf16" else 0, seed=3)  # fmt: skip
    _compare(cpu, emu, f"remainder {moments}")
    assert not torch.equal(cpu["master"], state["master"])  # the step wrote remainders


@pytest.mark.parametrize("views", ["aligned", "unaligned"])
@pytest.mark.parametrize(
    "pdtype,amsgrad,master,rounding",
    [(torch.float32, True, False, 0), (torch.bfloat16, False, True, 0),
     (torch.bfloat16, True, False, 1), (torch.bfloat16, False, False, 0)],
    ids=["fp32-amsgrad", "bf16-master", "bf16-amsgrad-stochastic", "bf16"],
)  # fmt: skip
def test_update_8bit_overflow_matches_cpu(sim, schedule, pdtype, amsgrad, master, rounding,
                                          views):  # fmt: skip
    """Moments that overflow (Note [8-bit moments]): gradients of 1e19, +-1e30, FLT_MAX (where
    the dtype holds it) and subnormals, and stored moments already holding infinities and a
    block of nothing but them; the special blocks decode, step and code again on the
    emulated device as on the CPU, in the direct kernel and the edge kernel. 16-bit
    parameters without a master also hold +-inf, NaN and subnormals, which the direct
    kernel rounds a pair at a time (stochastically: the canonical NaN's clamp, infinities
    kept whatever the random bits)."""
    from test_quant8 import _bucket_8bit, _extreme_grads

    sizes = [97, 1025, 256, 4097]
    params, grads, state, _ = _bucket_8bit(sizes, amsgrad, pdtype, seed=5, master=master)
    grads = _extreme_grads(grads, 1, pdtype)
    for key, code in (("exp_avg_sq", "unsigned"), ("max_exp_avg_sq", "unsigned")):
        if state[key] is None:
            continue
        v = ops.unpack_8bit(state[key], code)
        v[3] = v[1024 + 5] = float("inf")
        v[2048:2304] = float("inf")  # the 256 block: every moment infinite
        state[key] = ops.pack_8bit(v, code)
    m = ops.unpack_8bit(state["exp_avg"], "signed")
    m[1024 + 7] = float("-inf")
    state["exp_avg"] = ops.pack_8bit(m, "signed")
    if pdtype != torch.float32 and not master:
        specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e-40, -0.0])
        for p in params:  # each value at an even and at an odd element (both halves of a pair)
            for first in (1, 2):
                at = torch.arange(first, p.numel(), 7)[: specials.numel()]
                p[at] = specials[: at.numel()].to(pdtype)
    if views == "unaligned":
        params = [torch.empty(p.numel() + 1, dtype=p.dtype)[1:].copy_(p) for p in params]
    state = dict(state, params=params, grads=grads)
    cpu, emu = _run_both(sim, state, rounding=rounding, seed=11)
    _compare(cpu, emu, f"8-bit overflow {pdtype}")
    for key, code in (("exp_avg", "signed"), ("exp_avg_sq", "unsigned")):  # special blocks
        assert torch.isinf(ops.unpack_8bit(cpu[key], code)).any(), key


# Flat tensors (sizes) and tensors of rows (shapes) for the 4-bit kernels: whole blocks, a
# tensor's shorter last block (odd too), a tile edge (4096), rows of whole blocks (flat),
# rows that are not whole blocks whose whole blocks are aligned in every row (500), in every
# other row (130, 1030: the direct kernel's and the edge kernel's blocks in one tensor), in
# no row (98, 198), rows of odd length (97: a pad nibble a row) and rows past a tile.
SIZES_4BIT = [97, 0, 1025, 128, 4097, 8192, 1]
ROWS_4BIT = [(3, 98), (5, 130), (4, 256), (70, 130), (9, 500), (2, 3, 66), (7, 1030), (3, 97)]


def _bucket_4bit(amsgrad, pdtype, seed, master=False, specials=False):
    """Parameters, gradients and a 4-bit state (Note [4-bit row blocks] in csrc/quant4.h)
    laid out as the optimizer does: slots from multiples of 128 nibbles, the flat tensors'
    scales at their offset / 128, the rows' scales after them (slots' columns 2 and 3); the
    codes random bytes (every code of both kinds; the pad nibbles of odd sizes and odd rows
    too, which no kernel may read, and which the step writes 0), the scales random
    over many binades with a block of zeros, and with ``specials`` negated scales (blocks
    with non-finite moments: their special codes decode to infinities and NaN)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(n,) for n in SIZES_4BIT] + ROWS_4BIT
    slots, offset, flat_blocks, rows_scales = [], 0, 0, []
    for i, shape in enumerate(shapes):
        numel = math.prod(shape)
        rows, row = (1, numel) if len(shape) == 1 else (shape[0], numel // shape[0])
        ragged = len(shape) > 1 and row % 128 != 0
        nibbles = rows * (row + row % 2) if ragged else numel
        slots.append([offset, i, row if ragged else 0, 0])
        if ragged:
            rows_scales.append((i, rows * -(-row // 128)))
        offset += -(-nibbles // 128) * 128
    flat_blocks = offset // 128
    run = flat_blocks
    for i, count in rows_scales:
        slots[i][3] = run
        run += count
    params = [torch.randn(shape, generator=gen).to(pdtype) for shape in shapes]
    grads = [(torch.randn(shape, generator=gen) * 3).to(pdtype) for shape in shapes]
    codes = [torch.randint(0, 256, (offset // 2,), generator=gen, dtype=torch.uint8)
             for _ in range(3 if amsgrad else 2)]  # fmt: skip
    scales = torch.exp(torch.randn(len(codes) * run, generator=gen) * 4) * 1e-3
    scales[5] = 0.0
    if specials:
        scales[torch.randperm(scales.numel(), generator=gen)[: scales.numel() // 10]] *= -1
    master_buf = None
    if master:
        master_buf = torch.randn(offset, generator=gen)
        for p, (off, *_rest) in zip(params, slots, strict=True):
            master_buf[off : off + p.numel()] = p.float().flatten()
            master_buf[off : off + p.numel() : 3] += 1e-3
    state = dict(exp_avg=codes[0].view(torch.int8), exp_avg_sq=codes[1].view(torch.int8),
                 max_exp_avg_sq=codes[2].view(torch.int8) if amsgrad else None,
                 steps=torch.arange(len(shapes), dtype=torch.float32) * 2, master=master_buf,
                 slots=torch.tensor(slots, dtype=torch.int64), scales=scales)  # fmt: skip
    return dict(state, params=params, grads=grads)


@pytest.mark.parametrize("views", ["aligned", "unaligned"])
@pytest.mark.parametrize(
    "pdtype,amsgrad,master,rounding,specials",
    [(torch.float32, False, False, 0, False), (torch.float32, True, False, 0, True),
     (torch.bfloat16, True, False, 1, False), (torch.float16, False, True, 0, True),
     (torch.bfloat16, False, True, 0, False), (torch.bfloat16, True, "remainder", 0, True)],
    ids=["fp32", "fp32-amsgrad-specials", "bf16-amsgrad-stochastic", "fp16-master-specials",
         "bf16-master", "bf16-remainder-amsgrad-specials"],
)  # fmt: skip
def test_update_4bit_matches_cpu(sim, schedule, pdtype, amsgrad, master, rounding, specials,
                                 views):  # fmt: skip
    """4-bit moments (Note [4-bit CUDA step] in csrc/cuda/adamw_cuda.cu): the emulated direct
    kernel (a warp per block of 128, lane l its elements 4 l .. 4 l + 3, whole aligned blocks,
    those inside rows that are not whole blocks too) and edge kernel (shorter blocks, odd ones,
    unaligned views, pad nibbles) write the CPU kernel's parameters, masters or remainders,
    codes, scales and counters, bit for bit; with blocks of non-finite moments (negated
    scales) and gradients that overflow."""
    state = _bucket_4bit(amsgrad, pdtype, seed=23, master=bool(master), specials=specials)
    if master == "remainder":
        state = _with_remainders(state)
    if specials and pdtype != torch.float16:  # FP16 holds no overflowing gradient
        from test_quant8 import _extreme_grads

        state["grads"] = [g.view(-1) for g in _extreme_grads([g.flatten() for g in
                          state["grads"]], 1, pdtype)]  # fmt: skip
        state["grads"] = [g.view(p.shape) for g, p in zip(state["grads"], state["params"],
                                                           strict=True)]  # fmt: skip
    if views == "unaligned":  # odd element offsets: not aligned for the lanes' accesses
        state["params"] = [
            torch.empty(p.numel() + 1, dtype=p.dtype)[1:].view(p.shape).copy_(p) if i % 2 else p
            for i, p in enumerate(state["params"])
        ]
    cpu, emu = _run_both(sim, state, rounding=rounding, seed=29, grad_scale=torch.tensor([2.0]),
                         clip_coef=torch.tensor([0.75]), maximize=amsgrad)  # fmt: skip
    _compare(cpu, emu, f"4-bit {pdtype}")
    assert not torch.equal(cpu["exp_avg"], state["exp_avg"])  # the step wrote codes
    assert not torch.equal(cpu["scales"], state["scales"])


@pytest.mark.parametrize("first", [5, 2**32 - 7, 2**33 - 256, 2**40 + 2**32 - 1])
def test_edge_rounding_bits_across_a_multiple_of_2_32(sim, first):
    """The 8-bit edge kernels draw a block's random bits from its first index's high word
    (a block of rows that are not whole blocks may start anywhere): past a multiple of 2^32
    inside the block, the next one (rounding_high_at in csrc/adamw_math.h), the bits of
    rounding_bits(key, index) for every index, as the CPU draws them."""
    import numpy as np
    from test_state_precision import rounding_bits

    key = 0xC0FFEE11
    got = sim.rounding_bits_from(key, first, 300)
    want = rounding_bits(key, np.arange(first, first + 300, dtype=np.uint64))
    assert torch.equal(got, torch.from_numpy(want.astype(np.int64)))


def _rows_direct_mask(state, shapes, block, bits, p, g):
    """Which elements of each tensor of rows that are not whole blocks the direct kernel of
    a low-bit format steps (Note [8-bit row blocks] in csrc/quant8.h, Note [4-bit row
    blocks] in csrc/quant4.h): those of its whole blocks whose accesses are aligned for the
    lanes (8-bit: 16 bytes of elements, masters and remainders, 8 of codes; 4-bit: 4
    elements of each, the codes from a nibble that is a multiple of 4), and (8-bit) whose
    state indices keep their high 32 bits. Computed here from the data pointers, apart from
    the kernels' own predicate. {tensor index: bool mask over its elements}."""
    masks = {}
    for i, (off, _idx, row, _scale) in enumerate(state["slots"].tolist()):
        if row == 0:
            continue
        numel = math.prod(shapes[i])
        mask = torch.zeros(numel, dtype=torch.bool)
        for r in range(numel // row):
            for col in range(0, row - block + 1, block):  # the row's whole blocks
                first = r * row + col
                sk = off + first
                unit = r * (row + row % 2) + col if bits == 4 else first  # code (nibble) index
                ok = all(
                    (t.data_ptr() + first * t.element_size())
                    % (16 if bits == 8 else 4 * t.element_size())
                    == 0
                    for t in (p[i], g[i])
                )
                buf = state.get("master")
                if buf is not None:
                    width = 16 if bits == 8 else 4 * buf.element_size()
                    ok = ok and (buf.data_ptr() + sk * buf.element_size()) % width == 0
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    if state.get(key) is not None:
                        if bits == 8:
                            ok = ok and (state[key].data_ptr() + off + unit) % 8 == 0
                        else:
                            nibble = off + unit
                            ok = (
                                ok
                                and nibble % 4 == 0
                                and (state[key].data_ptr() + nibble // 2) % 2 == 0
                            )
                if bits == 8:
                    ok = ok and sk % 2**32 <= 2**32 - block
                mask[first : first + block] = ok
        masks[i] = mask
    return masks


@pytest.mark.parametrize("views", ["aligned", "unaligned"])
@pytest.mark.parametrize("bits", [8, 4], ids=["8bit", "4bit"])
@pytest.mark.parametrize(
    "pdtype,amsgrad,master,rounding",
    [(torch.float32, True, False, 0), (torch.bfloat16, False, False, 1),
     (torch.float16, True, True, 0), (torch.bfloat16, True, "remainder", 0)],
    ids=["fp32-amsgrad", "bf16-stochastic", "fp16-amsgrad-master", "bf16-remainder"],
)  # fmt: skip
def test_rows_whole_blocks_take_the_direct_kernel(sim, schedule, pdtype, amsgrad, master,
                                                  rounding, bits, views):  # fmt: skip
    """Where rows are not whole blocks, their whole, aligned blocks are stepped with the
    lanes' wide accesses (the rows kernels, Pass8 in csrc/cuda/adamw_cuda.cu), not element
    by element by the edge kernels (issue 46):
    with the edge kernels not launched, exactly those blocks' parameters (and masters)
    hold the CPU kernel's new bits, and every other element of such a tensor its old
    ones."""
    if bits == 8:
        from test_quant8 import ROW_SHAPES, _row_bucket

        shapes = ROW_SHAPES
        params, grads, state, _ = _row_bucket(shapes, amsgrad, pdtype, seed=31,
                                              master=bool(master))  # fmt: skip
        state = dict(state, params=params, grads=grads)
    else:
        shapes = [(n,) for n in SIZES_4BIT] + ROWS_4BIT
        state = _bucket_4bit(amsgrad, pdtype, seed=31, master=bool(master))
        state["params"] = [p.flatten() for p in state["params"]]
        state["grads"] = [g.flatten() for g in state["grads"]]
    if master == "remainder":
        state = _with_remainders(state)
    if views == "unaligned":  # odd element offsets: no whole block aligned in these tensors
        state["params"] = [
            torch.empty(p.numel() + 1, dtype=p.dtype)[1:].copy_(p) if i % 2 else p
            for i, p in enumerate(state["params"])
        ]
    sim.set_edge_kernels(False)
    try:
        cpu, emu = _run_both(sim, state, rounding=rounding, seed=37)
    finally:
        sim.set_edge_kernels(True)
    masks = _rows_direct_mask(emu, shapes, 256 if bits == 8 else 128, bits, emu["params"],
                              emu["grads"])  # fmt: skip
    direct = sum(int(m.sum()) for m in masks.values())
    assert direct > 0 and sum(int((~m).sum()) for m in masks.values()) > 0
    for i, mask in masks.items():
        new, old, want = _bits(emu["params"][i]), _bits(state["params"][i]), _bits(cpu["params"][i])
        assert torch.equal(new[mask], want[mask]), f"{bits}-bit rows: tensor {i}'s direct blocks"
        assert torch.equal(new[~mask], old[~mask]), f"{bits}-bit rows: tensor {i}'s edge blocks"
        assert not mask.any() or not torch.equal(want[mask], old[mask])  # the step moved them
        if emu.get("master") is not None:
            off = int(state["slots"][i, 0])
            at = torch.arange(off, off + mask.numel())
            assert torch.equal(_bits(emu["master"][at[mask]]), _bits(cpu["master"][at[mask]]))
            assert torch.equal(_bits(emu["master"][at[~mask]]), _bits(state["master"][at[~mask]]))


@pytest.mark.parametrize("control", ["found_inf", "stats-skip", "stats-clip", "lr-tensor",
                                     "bad-scale"])  # fmt: skip
def test_update_controls_match_cpu(sim, schedule, control):
    """What the kernels read from device memory: a skip (found_inf, a non-finite count, a
    scale that cannot divide), the clip from the statistics, a Tensor lr."""
    state = _bucket(torch.float32, torch.float32, True, False, [97, 1025, 5], True, seed=3)
    kwargs = dict(
        found_inf=dict(found_inf=torch.tensor([1.0])),
        **{"stats-skip": dict(stats=torch.tensor([4.0, 1.0, 2.0]), max_grad_norm=1.0),
           "stats-clip": dict(stats=torch.tensor([400.0, 9.0, 0.0]), max_grad_norm=1.0),
           "lr-tensor": dict(lr_tensor=torch.tensor([3e-3], dtype=torch.float64)),
           "bad-scale": dict(grad_scale=torch.tensor([0.0]))},
    )[control]  # fmt: skip
    before = _clone(state)
    cpu, emu = _run_both(sim, state, **kwargs)
    _compare(cpu, emu, control)
    if control in ("found_inf", "stats-skip", "bad-scale"):
        _compare(cpu, before, f"{control} leaves everything as it was")


def test_update_past_2_31_elements(sim, schedule):
    """A slice whose state offset is past 2^31 elements: the launch's state base is moved
    back by 2^31 elements and the table's offsets forward (64-bit offsets end to end),
    without allocating 8 GiB; the result equals the plain launch's."""
    state = _bucket(torch.float32, torch.float32, True, False, [97, 5000], False, seed=11)
    plain = _clone(state)
    far = _clone(state)
    sim.adamw(plain["params"], plain["grads"], plain["exp_avg"], plain["exp_avg_sq"],
              plain["max_exp_avg_sq"], plain["steps"], plain["slots"], None, None, None, None,
              1e-2, 0.9, 0.99, 1e-8, 0.1, 0.0, False, None, None, 0, 0, True, None)  # fmt: skip
    sim.adamw_far(far["params"], far["grads"], far["exp_avg"], far["exp_avg_sq"],
                  far["max_exp_avg_sq"], far["steps"], far["slots"], 2**31 + 16)  # fmt: skip
    _compare(far, plain, "offsets past 2^31")


# ------------------------------------------------------------------ the statistics


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_analyze_matches_cpu(sim, schedule, dtype):
    gen = torch.Generator().manual_seed(5)
    grads = [(torch.randn(n, generator=gen) * 50).to(dtype) for n in SIZES]
    grads[5][7] = float("inf")
    grads[7][4096] = float("nan")
    grads[9][65536] = float("-inf")
    rows_n = sum(ops.stats_rows_for(g.numel()) for g in grads)
    for scale in (None, torch.tensor([8.0])):
        cpu = torch.full((rows_n, 3), -1.0)
        emu = torch.full((rows_n, 3), -1.0)
        ops.analyze_gradient(grads, cpu, scale)
        sim.analyze(grads, scale, emu)
        _same(emu, cpu, f"analyze rows, scale {scale}")


@pytest.mark.parametrize("n_rows", [1, 3, 1024, 1025, 3000, 6000])  # 6000: blocks loop over rows
def test_merge_matches_cpu(sim, schedule, n_rows):
    gen = torch.Generator().manual_seed(n_rows)
    rows = torch.rand(n_rows, 3, generator=gen) * torch.tensor([1e3, 10.0, 0.0])
    rows[:, 2] = (torch.rand(n_rows, generator=gen) < 0.01).float()
    n_out = -(-n_rows // 1024)
    cpu, emu = torch.full((n_out, 3), -1.0), torch.full((n_out, 3), -1.0)
    ops.merge_gradient_stats(rows, cpu)
    sim.merge(rows, emu)
    _same(emu, cpu, f"merge of {n_rows} rows")


@pytest.mark.parametrize("n", [1, 2, 7])
def test_merge_chunks_matches_cpu(sim, schedule, n):
    reports = torch.rand(n, 3, generator=torch.Generator().manual_seed(n)) * 100
    cpu, emu = torch.empty(3), torch.empty(3)
    ops.merge_gradient_stats_chunks(reports, cpu)
    sim.merge_chunks(reports, emu)
    _same(emu, cpu, f"fold of {n} reports")


def _quantize_matches_cpu(sim, x: torch.Tensor, code: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x's codes and scales by the emulated quantize kernel, asserted equal to the CPU's
    (returned)."""
    codes, scales = ops.quantize_8bit(x, code)
    emu_codes = torch.full_like(codes, 0xAA)
    emu_scales = torch.full_like(scales, -1.0)
    sim.quantize_8bit(x, emu_codes, emu_scales, ops.CODES_8BIT.index(code))
    assert torch.equal(emu_codes, codes)
    _same(emu_scales, scales, "scales")
    return codes, scales


@pytest.mark.parametrize("code", ops.CODES_8BIT)
@pytest.mark.parametrize("n", [0, 1, 97, 256, 1025, 4097])  # 4097: blocks loop (4 resident)
def test_quantize_8bit_matches_cpu(sim, schedule, code, n):
    """Blockwise 8-bit codes (Note [8-bit moments] in csrc/quant8.h): codes, scales and
    decoded values of the emulated kernels equal the CPU kernels', with wide magnitudes,
    a block holding a NaN and one holding an infinity (their special codes and negated
    scales), one of subnormals with an infinity (scale -0.0), a block of zeros and ties."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    if n >= 1025:
        x[300] = float("nan")
        x[700] = float("-inf")
        x[701] = float("inf")
        x[768:1024] = 0.0
    if n >= 4097:
        x[1024:1280] = 1e-40
        x[1100] = float("inf")
        x[1280:1536] = float("nan")
    if code == "unsigned":
        x = x.abs()
    codes, scales = _quantize_matches_cpu(sim, x, code)
    emu_out = torch.full_like(x, -1.0)
    sim.dequantize_8bit(codes, scales, emu_out, ops.CODES_8BIT.index(code))
    _same(emu_out, ops.dequantize_8bit(codes, scales, code), "decoded values")


@pytest.mark.parametrize("code", ops.CODES_8BIT)
def test_dequantize_every_code_matches_cpu(sim, code):
    """All 256 codes of each kind decoded by the CUDA kernels (decode_lane8, the update's
    decoder: two codes at a time through FP16, Note [8-bit CUDA decode]) and by the CPU kernels,
    with scales of every kind: tiny, huge, zero, one, and the negated scales of blocks with
    non-finite values (their special codes), -0.0 and NaN of either sign among them."""
    # 2^120 and the FP32 value below it: where the signed decoder's product by scale 2^8
    # stops being exact and it multiplies by 2^8 first (Note [8-bit CUDA decode]).
    below = torch.tensor(2.0**120).view(torch.int32).sub(1).view(torch.float32).item()
    scales = torch.tensor([1.0, 3.0e38, 1.5e-38, 0.0, 7.25e-3, 2.0**-100, -1.0, -3.0e38, -0.0,
                           -7.25e-3, float("nan"), -float("nan"), 2.0**120, below, 2.0**119,
                           -(2.0**120)])  # fmt: skip
    codes = torch.arange(256, dtype=torch.uint8).repeat(scales.numel())
    out = torch.full((codes.numel(),), -1.0)
    sim.dequantize_8bit(codes, scales, out, ops.CODES_8BIT.index(code))
    _same(out, ops.dequantize_8bit(codes, scales, code), f"{code} codes")


@pytest.mark.parametrize("code", ops.CODES_8BIT)
def test_quantize_8bit_every_class_of_value_matches_cpu(sim, code):
    """The CUDA codec's pairs through FP16 (encode_pair8: cvt.rz.f16x2.f32, rounding to
    odd, then to nearest on both halves; Note [8-bit codes through FP16]) give encode8's
    codes on every class of value: every FP16 value below 2 (and times 2^8, the signed
    code's grid) with its FP32 neighbours, every midpoint between codes, subnormals, zeros,
    random bit patterns, both signs (tests/test_cpu_isa.py's inputs)."""
    from test_cpu_isa import _codec_inputs

    x = _codec_inputs(code)
    _quantize_matches_cpu(sim, x, code)


def _quantize4_matches_cpu(sim, x: torch.Tensor, code: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x's 4-bit codes and scales (flat blocks) by the emulated kernel, asserted equal to the
    CPU's (returned)."""
    c = ops.CODES_4BIT.index(code)
    codes = torch.empty((x.numel() + 1) // 2, dtype=torch.uint8)
    scales = torch.empty(-(-x.numel() // ops.BLOCK_4BIT))
    torch.ops.ruda_torch.quantize_4bit(x, codes, scales, c)
    emu_codes = torch.full_like(codes, 0xAA)
    emu_scales = torch.full_like(scales, -1.0)
    sim.quantize_4bit(x, emu_codes, emu_scales, c)
    assert torch.equal(emu_codes, codes)
    _same(emu_scales, scales, "scales")
    return codes, scales


@pytest.mark.parametrize("code", ops.CODES_4BIT)
@pytest.mark.parametrize("n", [0, 1, 97, 128, 1025, 4097])  # 4097: blocks loop (4 resident)
def test_quantize_4bit_matches_cpu(sim, schedule, code, n):
    """Blockwise 4-bit codes (Note [4-bit moments] in csrc/quant4.h): codes, scales and
    decoded values of the emulated kernels (Note [4-bit CUDA lanes]) equal the CPU kernels',
    with wide magnitudes, blocks holding a NaN or infinities (special codes, negated scales),
    one of subnormals with an infinity (scale -0.0), a block of zeros, odd sizes, and an
    unaligned view (element by element)."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n + 1, generator=gen) * torch.exp(torch.randn(n + 1, generator=gen) * 3)
    if n >= 1025:
        x[300] = float("nan")
        x[700] = float("-inf")
        x[701] = float("inf")
        x[768:896] = 0.0
    if n >= 4097:
        x[1024:1152] = 1e-40
        x[1100] = float("inf")
        x[1280:1408] = float("nan")
    if code == "unsigned":
        x = x.abs()
    for view in (x[:n], x[1:]):  # 16-byte aligned, and not
        codes, scales = _quantize4_matches_cpu(sim, view, code)
        emu_out = torch.full_like(view, -1.0)
        sim.dequantize_4bit(codes, scales, emu_out, ops.CODES_4BIT.index(code))
        cpu_out = torch.empty_like(view)
        torch.ops.ruda_torch.dequantize_4bit(codes, scales, cpu_out, ops.CODES_4BIT.index(code))
        _same(emu_out, cpu_out, "decoded values")


@pytest.mark.parametrize("code", ops.CODES_4BIT)
def test_dequantize_every_4bit_code_matches_cpu(sim, code):
    """All 16 codes of each kind (every byte: both nibbles) decoded by the CUDA kernels
    (decode_lane4, the update's decoder: a code book in shared memory) and the CPU kernels,
    with scales of every kind: tiny, huge, zero, one, negated (blocks with non-finite values:
    their special codes), -0.0 and NaN of either sign."""
    scales = torch.tensor([1.0, 3.0e38, 1.5e-38, 0.0, 7.25e-3, 2.0**-100, -1.0, -3.0e38, -0.0,
                           -7.25e-3, float("nan"), -float("nan"), 2.0**120])  # fmt: skip
    scales = scales.repeat_interleave(4)  # 4 blocks of 64 bytes: every byte under each scale
    codes = torch.arange(256, dtype=torch.uint8).repeat(scales.numel() // 4)
    c = ops.CODES_4BIT.index(code)
    out = torch.full((2 * codes.numel(),), -1.0)
    sim.dequantize_4bit(codes, scales, out, c)
    want = torch.empty_like(out)
    torch.ops.ruda_torch.dequantize_4bit(codes, scales, want, c)
    _same(out, want, f"{code} codes")


@pytest.mark.parametrize("code", ops.CODES_4BIT)
def test_quantize_4bit_every_class_of_value_matches_cpu(sim, code):
    """quantize4 per lane (encode_lane4) gives the CPU's codes on every class of value: the
    CPU ISA test's inputs (every FP16 value below 2 with its FP32 neighbours, midpoints
    between codes, subnormals, zeros, random bit patterns, both signs)."""
    from test_cpu_isa import _codec4_inputs

    _quantize4_matches_cpu(sim, _codec4_inputs(code).reshape(-1), code)


def test_emulated_fp16_toward_zero_is_the_hosts(sim):
    """The emulation of cvt.rz.f16.f32 (csrc/cuda_sim/cuda_fp16.h) against the nearest FP16
    stepped toward zero where it rounded away, on every FP16 value with its FP32
    neighbours, both signs, past the largest finite FP16 and into FP32's subnormals."""
    halves = torch.arange(0, 0x7C00, dtype=torch.int16).view(torch.float16).float()
    bits = torch.cat([halves.view(torch.int32) + d for d in (-2, -1, 0, 1, 2)]).clamp(min=0)
    x = torch.cat([bits.view(torch.float32), torch.tensor([65520.0, 1e5, 3e38, 1e-40])])
    x = torch.cat([x, -x])
    nearest = x.half()
    away = nearest.float().abs() > x.abs()
    want = torch.where(away, (nearest.view(torch.int16) - 1), nearest.view(torch.int16))
    got = sim.f16_bits_toward_zero(x)
    assert torch.equal(got.to(torch.int16), want)


def test_grid_is_sized_from_the_emulated_device(sim):
    """The launch code sizes grids from the device's occupancy (max_resident_blocks): on
    the emulated device, smaller than the work, so that blocks loop over units."""
    assert sim.resident_blocks() == 4


def test_every_kernel_is_emulated():
    """Every __global__ function of csrc/cuda has a test here: a new kernel without one
    fails."""
    found = set()
    for path in sorted((ROOT / "csrc" / "cuda").glob("*.cu")):
        text = path.read_text()
        for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)", text):
            found.add(m.group(1))
    assert found, "no __global__ function found: the pattern is stale"
    missing = sorted(found - set(COVERED))
    assert not missing, f"kernels without an emulated test: {missing}"
    for test in set(COVERED.values()):
        assert test in globals(), test


# ------------------------------------------------------------------ flat buckets


def test_flat_bucket_tables_follow_the_subsets(sim, schedule):
    """A flat-gradient bucket (Note [Flat gradient buckets]) stepped on the emulated
    device through its device tables, written by the rules of Note [Flat device tables]
    (csrc/bindings.h, shared with csrc/cuda/ops_cuda.cpp): the update table after every
    change of the subset of parameters with a gradient and only then, a statistics piece
    once per subset; every step and every statistics row equal the CPU kernels' on the
    same subset."""
    sizes = [97, 0, 1025, 3, 4097]
    gen = torch.Generator().manual_seed(21)
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // 16) * 16
    grad = torch.randn(total, generator=gen)
    views = [torch.empty(0).set_(grad.untyped_storage(), off, (n,)) for off, n in
             zip(offsets, sizes, strict=True)]  # fmt: skip
    params = [torch.randn(n, generator=gen) for n in sizes]
    slots = torch.tensor([[off, i] for i, off in enumerate(offsets)], dtype=torch.int64)
    state = dict(exp_avg=torch.zeros(total), exp_avg_sq=torch.zeros(total),
                 vmax=torch.zeros(total), steps=torch.zeros(len(sizes)))  # fmt: skip
    cpu = {k: v.clone() for k, v in state.items()}
    cpu_params = [p.clone() for p in params]
    flat = sim.flat_new(params, params, views, grad, state["exp_avg"], state["exp_avg_sq"],
                        state["vmax"], state["steps"], slots, None)  # fmt: skip
    subsets = [None, [0, 2, 4], [0, 2, 4], None, [1, 3], None, [0, 2, 4]]
    for step, active in enumerate(subsets):
        grad.copy_(torch.randn(total, generator=gen))
        ids = list(range(len(sizes))) if active is None else active
        sim.flat_step(flat, active, True, 1e-2, 0.1, None, None, 0.0)
        ops.adamw_scaled_([cpu_params[i] for i in ids], [views[i] for i in ids], cpu["exp_avg"],
                          cpu["exp_avg_sq"], cpu["vmax"], cpu["steps"], slots[ids].contiguous(),
                          lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)  # fmt: skip
        for i, (a, b) in enumerate(zip(params, cpu_params, strict=True)):
            _same(a, b, f"step {step} ({active}): param {i}")
        for key in ("exp_avg", "exp_avg_sq", "vmax", "steps"):
            _same(state[key], cpu[key], f"step {step} ({active}): {key}")
        # The statistics of the subset in two pieces, as the optimizer splits a large one.
        half = len(ids) // 2
        for lo, hi in ((0, half), (half, len(ids))):
            rows_n = sum(ops.stats_rows_for(sizes[i]) for i in ids[lo:hi])
            emu, ref = torch.full((rows_n, 3), -1.0), torch.full((rows_n, 3), -1.0)
            sim.flat_analyze(flat, active, lo, hi, None, emu)
            ops.analyze_gradient([views[i] for i in ids[lo:hi]], ref)
            _same(emu, ref, f"step {step} ({active}): statistics piece [{lo}, {hi})")
    changes = 1 + sum(a != b for a, b in zip(subsets, subsets[1:], strict=False))
    table_writes, stats_writes = sim.flat_writes(flat)
    assert table_writes == changes, (table_writes, changes)
    # Each subset's two pieces, written once per run of equal subsets (an empty piece
    # [0, 0) of a one-parameter subset has no rows and no write).
    assert 0 < stats_writes <= 2 * changes
