"""Every state entry's format is checked by one function on every path that reads an entry
(Note [8-bit entry formats] in ruda_torch/_state8bit.py, check_state_entry in
ruda_torch/_validate.py): ``load_state_dict``, an entry a user puts into
``optimizer.state`` (adopted at the next step), ``ruda_torch.dequantize_state_dict`` and
the template ``ruda_torch.match_checkpoint`` makes for a distributed checkpoint (DCP).
Every key of every format (moments as values, 8-bit codes and scales of the rows' blocks
and of the first release's, FP32 and remainder masters, the step counter), spoiled every
way a hand-edited or foreign state dict spoils it, is refused before anything is written,
with a message that names the key, what was found and what is accepted; every valid form
loads as what it holds (codes with gaps, the first format's scales). Meshes: FSDP2 entries
in tests/test_state_8bit_mesh.py.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from test_ops import same_bits
from torch import nn

import ruda_torch
from ruda_torch import ops
from ruda_torch._common import EIGHT_BIT_KEYS, codes_key, scales_key

# Rows shorter than two blocks and not whole ones (the issue's (64, 80): 64 row scales, 20
# flat blocks), rows of whole blocks, one row, rows of a block and a shorter one.
SHAPES = {"ragged": (64, 80), "whole": (20, 256), "one-row": (5120,), "cube": (6, 5, 100)}
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _code(key: str) -> str:
    return "signed" if key == "exp_avg" else "unsigned"


def _trained(precision: str = "8bit", dtype=torch.float32, master=False):
    gen = torch.Generator().manual_seed(3)
    params = [nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(dtype))
              for s in SHAPES.values()]  # fmt: skip
    opt = ruda_torch.AdamW(params, lr=1e-2, amsgrad=True, fused_step=True,
                           state_precision=precision, min_8bit_size=0,
                           master_weights=master)  # fmt: skip
    for _ in range(2):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * torch.rand(p.shape, generator=gen)
                      .pow(6)).to(dtype)  # fmt: skip
        opt.step()
    return params, opt


def _snapshot(params, opt) -> list:
    return [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
            for p in params]  # fmt: skip


def _unchanged(params, opt, before, replaced: int | None = None) -> None:
    """Parameters and state as ``before``; the entry of parameter ``replaced`` (one a
    user replaced) not compared."""
    for i, (p, (value, entry)) in enumerate(zip(params, before, strict=True)):
        assert same_bits(p.detach(), value)
        if i == replaced:
            continue
        assert opt.state[p].keys() == entry.keys()
        for k, v in entry.items():
            assert same_bits(opt.state[p][k], v), k


def _spoiled(sd: dict, index: int, key: str, value) -> dict:
    entry = dict(sd["state"][index])
    entry[key] = value
    return {**sd, "state": {**sd["state"], index: entry}}


# ------------------------------------------------------------------ what is refused


def _meta(t):
    return torch.empty_like(t, device="meta")


def _gapped(t):
    """``t``'s values in a tensor of its shape that is not contiguous."""
    out = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)[..., ::2]
    return out.copy_(t)


def _scales_cases(scales: torch.Tensor, shape) -> dict:
    """Spoiled scales of a parameter of ``shape``: name -> (tensor, regex of the message)."""
    rows = ops.scales_shape_8bit(shape)
    flat_blocks = -(-torch.Size(shape).numel() // 256)
    accepted = re.escape(str(rows))
    cases = {
        "dtype": (scales.double(), "must be float32"),
        "one-more": (torch.cat([scales.reshape(-1), torch.ones(1)]), accepted),
        "one-fewer": (scales.reshape(-1)[:-1].clone(), accepted),
        "extra-dim": (scales.reshape(1, *scales.shape), accepted),
        "meta": (_meta(scales), "a meta tensor"),
        "not-a-tensor": (scales.tolist(), "must be a tensor with values, got list"),
    }
    if len(shape) >= 2:
        if rows[0] * rows[1] != flat_blocks:  # rows flattened: the issue's first class
            cases["rows-flattened"] = (scales.reshape(-1).clone(), accepted)
        if scales.shape[-1] > 1:
            cases["not-contiguous"] = (scales.t().contiguous().t(), "not contiguous")
    return cases


def _codes_cases(codes: torch.Tensor) -> dict:
    return {
        "dtype": (codes.to(torch.int8), "must be uint8"),
        "flattened": (
            codes.reshape(1, -1),
            re.escape(f"but its parameter has shape {tuple(codes.shape)}"),
        ),
        "meta": (_meta(codes), "a meta tensor"),
    }


EIGHT_BIT_CASES = [
    (name, key, case)
    for name, shape in SHAPES.items()
    for key in EIGHT_BIT_KEYS
    for case in (
        _scales_cases(torch.ones(ops.scales_shape_8bit(shape)), shape)
        if key.endswith("_scales")
        else _codes_cases(torch.zeros(shape, dtype=torch.uint8))
    )
]


def _eight_bit_case(name: str, key: str, case: str, sd: dict):
    index = list(SHAPES).index(name)
    value = sd["state"][index][key]
    cases = (_scales_cases(value, SHAPES[name]) if key.endswith("_scales")
             else _codes_cases(value))  # fmt: skip
    spoiled, match = cases[case]
    return index, spoiled, match


@pytest.mark.parametrize(
    "name, key, case", EIGHT_BIT_CASES, ids=["-".join(c) for c in EIGHT_BIT_CASES]
)
def test_a_spoiled_8bit_entry_is_refused_on_every_path(name, key, case):
    """load_state_dict, the entry put into optimizer.state, dequantize_state_dict: each
    refuses, naming the key and the shapes, and nothing changes."""
    params, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    index, spoiled, match = _eight_bit_case(name, key, case, sd)
    bad = _spoiled(sd, index, key, spoiled)
    before = _snapshot(params, opt)
    with pytest.raises(ValueError, match=match) as e:
        opt.load_state_dict(bad)
    assert repr(key) in str(e.value) and f"loaded state[{index}]" in str(e.value)
    _unchanged(params, opt, before)
    if case != "flattened":  # dequantize_state_dict has no parameter: codes of any shape
        with pytest.raises(ValueError, match=match):  # are one's, with scales to match
            ruda_torch.dequantize_state_dict(bad)
    opt.state[params[index]] = dict(bad["state"][index])
    with pytest.raises(ValueError, match=match):
        opt.step()
    _unchanged(params, opt, before, replaced=index)


def test_the_issue_examples():
    """Row scales of a (64, 80) parameter flattened to (64,) (decoded 40% off as 20 flat
    blocks before), and 21 scales for a 1-D parameter of 20 blocks (the extra one ignored
    before): refused by every path, the message naming what was found and accepted."""
    params, opt = _trained()
    sd = opt.state_dict()
    bad = _spoiled(sd, 0, "exp_avg_scales", sd["state"][0]["exp_avg_scales"].reshape(-1).clone())
    for call in (ruda_torch.dequantize_state_dict, opt.load_state_dict):
        with pytest.raises(ValueError, match=r"\['exp_avg_scales'\] has shape \(64,\); .* "
                                             r"shape \(64, 1\) or \(20,\)"):  # fmt: skip
            call(bad)
    scales = sd["state"][2]["exp_avg_sq_scales"]
    bad = _spoiled(sd, 2, "exp_avg_sq_scales", torch.cat([scales, scales[:1]]))
    with pytest.raises(ValueError, match=r"has shape \(21,\); .* have shape \(20,\)"):
        opt.load_state_dict(bad)


def test_messages_name_the_parameter_where_the_state_dict_does():
    params, _ = _trained()
    named = ruda_torch.AdamW([("w", params[0])], fused_step=True, state_precision="8bit",
                             min_8bit_size=0)  # fmt: skip
    params[0].grad = torch.ones_like(params[0])
    named.step()
    sd = named.state_dict()
    bad = _spoiled(sd, 0, "exp_avg_scales", torch.ones(3))
    with pytest.raises(
        ValueError, match=r"loaded state\[0\] \(parameter 'w'\)\['exp_avg_scales'\]"
    ):
        named.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"state_dict\['state'\]\[0\] \(parameter 'w'\)"):
        ruda_torch.dequantize_state_dict(bad)


VALUE_CASES = {
    # key: [(case, spoil, regex)]
    "exp_avg": [
        ("shape", lambda t: t.reshape(-1)[:-1].clone(), "has shape"),
        (
            "int",
            lambda t: t.to(torch.int32),
            "must be a floating tensor with values, got a torch.int32",
        ),
        ("meta", _meta, r"got a meta tensor \(torch.float32"),
        ("list", lambda t: t.tolist(), "got list"),
    ],
    "master_param": [
        ("shape", lambda t: t.reshape(1, -1), "has shape"),
        (
            "int",
            lambda t: t.to(torch.int16),
            "must be a floating tensor with values, got a torch.int16",
        ),
        ("meta", _meta, r"got a meta tensor \(torch.float32"),
    ],
    "master_remainder": [
        ("shape", lambda t: t.reshape(-1)[:-1].clone(), "has shape"),
        ("float", lambda t: t.float(), "must be an int16 tensor .*got a torch.float32 tensor"),
        ("meta", _meta, r"must be an int16 tensor .*got a meta tensor \(torch.int16, which"),
        ("beside-master", None, "holds both 'master_param' and 'master_remainder'"),
    ],
    "step": [
        ("negative", lambda t: torch.tensor(-1.0), "non-negative integer"),
        ("fraction", lambda t: torch.tensor(1.5), "non-negative integer"),
        ("shape", lambda t: torch.ones(2), "must hold one value"),
        ("meta", _meta, "meta tensor"),
    ],
}
_VALUE_FORMATS = {"exp_avg": ("fp32", torch.float32, False), "step": ("fp32", torch.float32, False),
                  "master_param": ("8bit", torch.bfloat16, True),
                  "master_remainder": ("8bit", torch.bfloat16, "remainder")}  # fmt: skip


VALUE_KEY_CASES = [(k, c[0]) for k, cases in VALUE_CASES.items() for c in cases]


@pytest.mark.parametrize("key, case", VALUE_KEY_CASES, ids=["-".join(c) for c in VALUE_KEY_CASES])
def test_a_spoiled_value_entry_is_refused_on_every_path(key, case):
    precision, dtype, master = _VALUE_FORMATS[key]
    params, opt = _trained(precision, dtype, master)
    sd = copy.deepcopy(opt.state_dict())
    spoil, match = next((s, m) for c, s, m in VALUE_CASES[key] if c == case)
    index = 1
    value = (torch.zeros(SHAPES["whole"]) if spoil is None
             else spoil(sd["state"][index][key]))  # fmt: skip
    bad = _spoiled(sd, index, "master_param" if spoil is None else key, value)
    before = _snapshot(params, opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    _unchanged(params, opt, before)
    opt.state[params[index]] = dict(bad["state"][index])
    with pytest.raises(ValueError, match=match):
        opt.step()
    _unchanged(params, opt, before, replaced=index)


def test_a_remainder_for_an_fp32_parameter_is_refused():
    params, opt = _trained(master="remainder")
    sd = opt.state_dict()
    bad = _spoiled(sd, 1, "master_remainder", torch.zeros(SHAPES["whole"], dtype=torch.int16))
    with pytest.raises(ValueError, match="remainder of the master of a bfloat16 parameter, but "
                                         "the parameter is torch.float32"):  # fmt: skip
        opt.load_state_dict(bad)


@pytest.mark.parametrize("master", [True, "remainder"])
def test_fp32_parameters_keep_no_master_with_either_master_option(master):
    """docs/usage.md: an FP32 parameter is its own master; both master options step it
    as master_weights=False does, with no master in its state."""
    (params, opt), (twins, plain) = _trained("fp32", master=master), _trained("fp32")
    for p, q in zip(params, twins, strict=True):
        assert same_bits(p.detach(), q.detach())
        assert opt.state[p].keys() == plain.state[q].keys() == {"step", *MOMENTS}


# ------------------------------------------------------------------ what loads


def test_codes_with_gaps_load_as_their_values():
    """docs/semantics.md: the rows' codes are read by position (their strides do not
    matter): every codes tensor of the state dict replaced by a copy with gaps loads, and
    steps, as the dense one does."""
    params, opt = _trained()
    twins, twin_opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    gapped = {**sd, "state": {i: {k: _gapped(v) if k.endswith("_codes") else v
                                  for k, v in e.items()} for i, e in sd["state"].items()}}  # fmt: skip
    assert not gapped["state"][0]["exp_avg_codes"].is_contiguous()
    want = ruda_torch.dequantize_state_dict(sd)["state"]
    got = ruda_torch.dequantize_state_dict(gapped)["state"]
    for i in want:
        for key in MOMENTS:
            assert same_bits(got[i][key], want[i][key]), (i, key)
    opt.load_state_dict(gapped)
    twin_opt.load_state_dict(sd)
    gen = torch.Generator().manual_seed(9)
    for p, q in zip(params, twins, strict=True):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()
    opt.step()
    twin_opt.step()
    for p, q in zip(params, twins, strict=True):
        assert same_bits(p.detach(), q.detach())
        for k, v in opt.state[p].items():
            assert same_bits(v, twin_opt.state[q][k]), k


def _first_format(codes_values: torch.Tensor, key: str):
    """A pair of the first 8-bit format (one process): blocks of 256 codes in the dense
    codes' memory order, 1-D scales."""
    codes, scales = ops.quantize_8bit(codes_values.reshape(-1).contiguous(), _code(key))
    return codes.reshape(codes_values.shape), scales


def test_first_format_entries_load_and_need_dense_codes():
    """1-D scales of exactly one per block of a plain parameter of two or more dimensions
    are the first format's: loaded as those blocks say; its codes with gaps are refused
    (their memory order defines the blocks)."""
    params, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    values = ruda_torch.dequantize_state_dict(sd)["state"]
    first = {**sd, "state": {}}
    for i, entry in sd["state"].items():
        first["state"][i] = dict(entry)
        for key in MOMENTS:
            codes, scales = _first_format(values[i][key], key)
            first["state"][i][codes_key(key)], first["state"][i][scales_key(key)] = codes, scales
    want = [{k: ops.dequantize_8bit(e[codes_key(k)].reshape(-1), e[scales_key(k)], _code(k))
             .reshape(e[codes_key(k)].shape) for k in MOMENTS}
            for e in first["state"].values()]  # fmt: skip
    got = ruda_torch.dequantize_state_dict(first)["state"]
    for i in got:
        for key in MOMENTS:
            assert same_bits(got[i][key], want[i][key]), (i, key)
    opt.load_state_dict(first)
    loaded = ruda_torch.dequantize_state_dict(opt.state_dict())["state"]
    for i in range(len(params)):
        for key in MOMENTS:
            # Re-coded by the rows where the first format's blocks are not theirs: the values
            # of the rows' codes of what the first format held.
            assert same_bits(loaded[i][key], ops.dequantize_8bit(
                *ops.quantize_8bit(want[i][key], _code(key)), _code(key))), (i, key)  # fmt: skip
    bad = _spoiled(first, 0, "exp_avg_codes", _gapped(first["state"][0]["exp_avg_codes"]))
    with pytest.raises(ValueError, match="first 8-bit format, whose blocks follow the codes' "
                                         "memory order"):  # fmt: skip
        opt.load_state_dict(bad)


# ------------------------------------------------------------------ DCP templates


def test_match_checkpoint_refuses_scales_and_codes_of_no_format(tmp_path):
    """A DCP checkpoint (one process) whose 8-bit scales or codes are no format's shape:
    match_checkpoint, which reads them into a template of the checkpoint's shapes, refuses
    it naming the checkpoint's key, before dcp.load reads anything."""
    import torch.distributed.checkpoint as dcp

    params, opt = _trained()
    _, fp32 = _trained("fp32")  # a template of FP32 moments: it takes the checkpoint's form
    spoils = {
        "exp_avg_scales": (
            lambda t: t.reshape(-1).clone(),
            r"'optim\.state\.0\.exp_avg_scales' "
            r"is torch\.float32 of shape \(64,\); .* \(64, 1\) or \(20,\)",
        ),
        "exp_avg_sq_codes": (
            lambda t: t.reshape(-1).clone(),
            r"'optim\.state\.0\.exp_avg_sq_codes' "
            r"is torch\.uint8 of shape \(5120,\)",
        ),
        "max_exp_avg_sq_scales": (lambda t: t.double(), r"is torch\.float64 of shape \(64, 1\)"),
    }
    for key, (spoil, match) in spoils.items():
        sd = copy.deepcopy(opt.state_dict())
        sd["state"][0][key] = spoil(sd["state"][0][key])
        where = tmp_path / key
        dcp.save({"optim": sd}, checkpoint_id=str(where))
        with pytest.raises(ValueError, match=match):
            ruda_torch.match_checkpoint({"optim": fp32.state_dict()}, str(where))
    # The same checkpoint unspoiled: the FP32 optimizer's template takes its pairs.
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(tmp_path / "good"))
    template = ruda_torch.match_checkpoint({"optim": fp32.state_dict()}, str(tmp_path / "good"))
    assert template["optim"]["state"][0]["exp_avg_scales"].shape == (64, 1)


@pytest.mark.parametrize(
    "precision, master", [("fp32", False), ("bf16", "remainder"), ("8bit", True)],
    ids=["fp32", "bf16-remainder", "8bit-master"],
)  # fmt: skip
def test_a_dcp_checkpoint_of_torchs_adamw_loads_through_match_checkpoint(tmp_path, precision,
                                                                         master):  # fmt: skip
    """torch.optim.AdamW's DCP checkpoint (no master, none of our group options) lacks
    keys our template names: plain dcp.load stops at them; match_checkpoint's template
    leaves them out (Note [Checkpoint templates] in ruda_torch/_checkpoint.py) and the
    load gives what load_state_dict of torch's state dict gives, our options kept. And
    back: ours into torch's through the template and dequantize_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    dtype = torch.bfloat16 if master else torch.float32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 80), nn.Linear(80, 8)).to(dtype)
    theirs = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        theirs.step()
    dcp.save({"optim": get_optimizer_state_dict(model, theirs)}, checkpoint_id=str(tmp_path / "t"))
    kw = dict(lr=1e-2, fused_step=True, state_precision=precision, min_8bit_size=0,
              master_weights=master, amsgrad=True)  # fmt: skip
    ours = ruda_torch.AdamW(model.parameters(), **kw)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ours.step()  # state to read into, as DCP's users create it
    template = {"optim": get_optimizer_state_dict(model, ours)}
    with pytest.raises(BaseException, match="Missing key"):  # DCP's CheckpointException
        dcp.load(copy.deepcopy(template), checkpoint_id=str(tmp_path / "t"))
    sd = ruda_torch.match_checkpoint(template, str(tmp_path / "t"))
    dcp.load(sd, checkpoint_id=str(tmp_path / "t"))
    set_optimizer_state_dict(model, ours, sd["optim"])
    twin = ruda_torch.AdamW([nn.Parameter(p.detach().clone()) for p in model.parameters()], **kw)
    twin.load_state_dict(theirs.state_dict())
    twin._current_plan()
    assert ours.param_groups[0]["state_precision"] == precision  # ours, not the checkpoint's
    assert ours.param_groups[0]["master_weights"] == master
    want = twin.state_dict()["state"]
    for i, entry in ours.state_dict()["state"].items():
        assert entry.keys() == want[i].keys()
        for k, v in entry.items():
            assert same_bits(v, want[i][k]), (i, k)
    # Back: ours into torch's AdamW.
    dcp.save({"optim": get_optimizer_state_dict(model, ours)}, checkpoint_id=str(tmp_path / "o"))
    back = torch.optim.AdamW(model.parameters(), lr=1e-2)
    back.step()  # (zero gradients)
    sd = ruda_torch.match_checkpoint({"optim": get_optimizer_state_dict(model, back)},
                                     str(tmp_path / "o"))  # fmt: skip
    dcp.load(sd, checkpoint_id=str(tmp_path / "o"))
    set_optimizer_state_dict(model, back, ruda_torch.dequantize_state_dict(sd["optim"]))
    values = ruda_torch.dequantize_state_dict(ours.state_dict())["state"]
    for i, entry in back.state_dict()["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert same_bits(entry[k], values[i][k].to(entry[k].dtype)), (i, k)
