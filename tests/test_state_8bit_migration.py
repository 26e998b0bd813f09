"""Checkpoints of another form load: the first 8-bit format (fixtures/state8bit_v0, written
by that release: tools/make_state8bit_v0_fixture.py) through torch.save and through DCP on
the mesh it was saved on, then resharded in this format; and DCP checkpoints whose moments
have another form than the loading optimizer's (a 1-D parameter 8-bit on one process and
FP32 as an FSDP2 DTensor, another state_precision), matched by ruda_torch.match_checkpoint
(Note [Checkpoint templates] in ruda_torch/_checkpoint.py); and state entries laid out
unlike their parameter (Note [Entries in another layout])."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_distributed import run_scenario
from test_ops import same_bits
from test_state_8bit_mesh import _full, assert_same_state, full_state

import ruda_torch
from ruda_torch import ops
from ruda_torch._common import STATE_KEYS, codes_key, scales_key

_spec = importlib.util.spec_from_file_location(
    "make_state8bit_v0_fixture",
    Path(__file__).resolve().parent.parent / "tools" / "make_state8bit_v0_fixture.py",
)
v0 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(v0)

FIXTURES = v0.FIXTURE_DIR
NAMES = list(v0.SHAPES)


def distributed(test):
    """A test of gloo ranks (tests/test_distributed.py's run_scenario)."""
    gloo = pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(),
        reason="torch.distributed with the gloo backend is not available",
    )
    return pytest.mark.distributed(gloo(test))


def code_of(key: str) -> str:
    return "signed" if key == "exp_avg" else "unsigned"


def assert_holds(entry: dict, decoded: dict, what: str) -> None:
    """A loaded entry holds the moments ``decoded`` (FP32, the first release's decoding):
    as they are where it keeps FP32 moments, else their codes by the rows (what
    quantize_8bit makes of them)."""
    assert same_bits(entry["step"], decoded["step"]), what
    for key in STATE_KEYS:
        want = decoded[key].contiguous()
        if key in entry:
            assert same_bits(entry[key].contiguous(), want), f"{what}[{key!r}]"
            continue
        codes, scales = ops.quantize_8bit(want, code_of(key))
        assert same_bits(entry[codes_key(key)].contiguous(), codes), f"{what}[{codes_key(key)!r}]"
        assert same_bits(entry[scales_key(key)], scales), f"{what}[{scales_key(key)!r}]"


def test_a_first_format_torch_save_checkpoint_loads():
    """plain.pt, torch.save of the first release's state dict (one process): every 8-bit
    moment holds what that release decoded it to, coded by the rows; where its blocks were
    already the rows' (rows of whole blocks, one row) the codes and scales are its own bits;
    and the optimizer trains on exactly as one loaded with those FP32 moments."""
    ck = torch.load(FIXTURES / "plain.pt", weights_only=True)
    models, opts = [], []
    for sd in (ck["optim"], ck["decoded"]):
        model = v0.Net()
        model.load_state_dict(ck["model"])
        opt = ruda_torch.AdamW(model.parameters(), **v0.OPTIONS)
        opt.load_state_dict(sd)
        models.append(model)
        opts.append(opt)
    first, fp32 = ck["optim"]["state"], ck["decoded"]["state"]
    for i, (name, p) in enumerate(models[0].named_parameters()):
        entry = opts[0].state[p]
        assert_holds(entry, fp32[i], name)
        if name in ("whole", "flat"):
            for key in STATE_KEYS:
                assert same_bits(entry[codes_key(key)], first[i][codes_key(key)]), (name, key)
                assert same_bits(entry[scales_key(key)].flatten(), first[i][scales_key(key)])
        if name == "transposed":  # its codes were in the parameter's memory order
            assert first[i]["exp_avg_codes"].stride() == (1, 70)
    want = full_state(models[1], opts[1])
    assert_same_state(full_state(models[0], opts[0]), want, "loaded")
    for step in range(v0.STEPS, v0.STEPS + 2):
        for model, opt in zip(models, opts, strict=True):
            v0.feed(model, step)
            opt.step()
        assert_same_state(full_state(models[0], opts[0]), full_state(models[1], opts[1]),
                          f"step {step}")  # fmt: skip


def _dcp_sd(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _dcp_set(model, opt, sd: dict) -> None:
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


def _build(plain: bool = False, precision: str = "8bit"):
    """The fixture's model and optimizer: FSDP2 over every rank, or plain (no FSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    model = v0.Net()
    if not plain:
        v0.shard(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    options = {**v0.OPTIONS, "state_precision": precision}
    return model, ruda_torch.AdamW(model.parameters(), **options)


def scenario_first_format_dcp(rank: int, workdir: str) -> None:
    """On the 2 FSDP2 ranks it was saved on: dcp.load of the bare template refuses the first
    format's scales (a size mismatch); match_checkpoint's template loads, and every entry
    holds what the first release decoded; then 2 steps, saved in this format."""
    import torch.distributed.checkpoint as dcp

    path = str(FIXTURES / "fsdp2_2")
    model, opt = _build()
    sd = _dcp_sd(model, opt)
    with pytest.raises(dcp.api.CheckpointException) as refused:
        dcp.load(sd, checkpoint_id=path)
    assert all("Size mismatch" in str(e) for e in refused.value.failures.values())
    sd = ruda_torch.match_checkpoint(_dcp_sd(model, opt), path)
    dcp.load(sd, checkpoint_id=path)
    _dcp_set(model, opt, sd)
    decoded = torch.load(FIXTURES / "fsdp2_2_decoded.pt", weights_only=True)
    got = full_state(model, opt)
    for name in NAMES:
        assert same_bits(got[name][0], decoded[name][0]), name
        assert_holds(got[name][1], decoded[name][1], name)
    assert "exp_avg" in got["flat"][1]  # a 1-D DTensor: FP32 moments
    states = [got]
    for step in range(v0.STEPS, v0.STEPS + 2):
        v0.feed(model, step)
        opt.step()
        states.append(full_state(model, opt))
    dcp.save(_dcp_sd(model, opt), checkpoint_id=f"{workdir}/../migrated")
    if rank == 0:
        torch.save(states, f"{workdir}/../states.pt")


def scenario_migrated_dcp(rank: int, workdir: str) -> None:
    """The migrated checkpoint (this format) on another number of ranks: loaded with no
    help, the 2 ranks' bits after their last step; then a step, and the state is the same
    as on every other mesh (compared by the test)."""
    import torch.distributed.checkpoint as dcp

    states = torch.load(f"{workdir}/../states.pt", weights_only=True)
    model, opt = _build()
    sd = _dcp_sd(model, opt)
    dcp.load(sd, checkpoint_id=f"{workdir}/../migrated")
    _dcp_set(model, opt, sd)
    assert_same_state(full_state(model, opt), states[-1], f"{dist.get_world_size()} ranks")
    v0.feed(model, v0.STEPS + 2)
    opt.step()
    got = full_state(model, opt)
    if rank == 0:
        torch.save(got, f"{workdir}/next.pt")


@distributed
def test_a_first_format_dcp_checkpoint_loads_and_then_reshards(tmp_path):
    """Loaded on its 2 ranks, 2 steps, saved; that checkpoint on 1 and on 4 ranks: the same
    bits, and a step on each gives the same state."""
    (tmp_path / "first").mkdir()
    run_scenario(tmp_path / "first", "test_state_8bit_migration:scenario_first_format_dcp",
                 world=2)  # fmt: skip
    nexts = []
    for world in (1, 4):
        where = tmp_path / f"on{world}"
        where.mkdir()
        run_scenario(where, "test_state_8bit_migration:scenario_migrated_dcp", world=world)
        nexts.append(torch.load(where / "next.pt", weights_only=True))
    assert_same_state(nexts[0], nexts[1], "a step on 1 and on 4 ranks")


def scenario_first_format_elsewhere(rank: int, workdir: str, plain: bool) -> None:
    """The first format's DCP checkpoint of 2 ranks, here on 1 rank of FSDP2 or a plain
    model: refused by match_checkpoint, naming the entry and the mesh it was saved on."""
    model, opt = _build(plain)
    with pytest.raises(ValueError, match=r"'optim\.state\.whole\.exp_avg_scales'.*2 shards"):
        ruda_torch.match_checkpoint(_dcp_sd(model, opt), str(FIXTURES / "fsdp2_2"))


@distributed
@pytest.mark.parametrize("plain", [False, True], ids=["fsdp2-1", "plain"])
def test_a_first_format_dcp_checkpoint_of_another_mesh_is_refused(tmp_path, plain):
    run_scenario(tmp_path, "test_state_8bit_migration:scenario_first_format_elsewhere", world=1,
                 plain=plain)  # fmt: skip


def scenario_save(rank: int, workdir: str, plain: bool, precision: str) -> None:
    """STEPS steps of the fixture's model (plain: one process, no FSDP), saved with DCP,
    and the full state after them."""
    import torch.distributed.checkpoint as dcp

    model, opt = _build(plain, precision)
    for step in range(v0.STEPS):
        v0.feed(model, step)
        opt.step()
    dcp.save(_dcp_sd(model, opt), checkpoint_id=f"{workdir}/../ckpt")
    decoded = ruda_torch.dequantize_state_dict(opt.state_dict())["state"]
    full = {
        name: (_full(p), {k: _full(v) for k, v in decoded[i].items()})
        for i, (name, p) in enumerate(model.named_parameters())
    }
    if rank == 0:
        torch.save(full, f"{workdir}/../saved.pt")


def scenario_load_matched(rank: int, workdir: str, plain: bool) -> None:
    """The checkpoint of scenario_save loaded through match_checkpoint's template: every
    entry holds the saved moments (in this optimizer's form), and a step runs."""
    import torch.distributed.checkpoint as dcp

    model, opt = _build(plain)
    sd = ruda_torch.match_checkpoint(_dcp_sd(model, opt), f"{workdir}/../ckpt")
    dcp.load(sd, checkpoint_id=f"{workdir}/../ckpt")
    _dcp_set(model, opt, sd)
    saved = torch.load(f"{workdir}/../saved.pt", weights_only=True)
    got = full_state(model, opt)
    for name in NAMES:
        assert same_bits(got[name][0], saved[name][0]), name
        assert_holds(got[name][1], saved[name][1], name)
    v0.feed(model, v0.STEPS)
    opt.step()
    assert all(torch.isfinite(_full(p)).all() for p in model.parameters())


@distributed
@pytest.mark.parametrize(
    "save, load, precision",
    [(("plain", 1), ("fsdp2", 2), "8bit"), (("fsdp2", 2), ("plain", 1), "8bit"),
     (("fsdp2", 2), ("fsdp2", 4), "fp32"), (("plain", 1), ("fsdp2", 2), "bf16")],
    ids=["plain-to-fsdp2", "fsdp2-to-plain", "fp32-to-8bit", "bf16-to-8bit"],
)  # fmt: skip
def test_a_checkpoint_of_another_form_loads_through_match_checkpoint(tmp_path, save, load,
                                                                     precision):  # fmt: skip
    """A 1-D parameter of 5,000 elements is 8-bit on one process and FP32 as an FSDP2
    DTensor; a checkpoint of FP32 or BF16 moments loads into 8-bit ones."""
    for name, (layout, world) in (("save", save), ("load", load)):
        where = tmp_path / name
        where.mkdir()
        if name == "save":
            run_scenario(where, "test_state_8bit_migration:scenario_save", world=world,
                         plain=layout == "plain", precision=precision)  # fmt: skip
        else:
            run_scenario(where, "test_state_8bit_migration:scenario_load_matched", world=world,
                         plain=layout == "plain")  # fmt: skip


def scenario_other_placements(rank: int, workdir: str) -> None:
    """HSDP 2x2: state entries whose DTensors have the placements in the other order (local
    shards of the same shape, other elements), or that are plain full tensors, load as the
    full values they are (Note [Entries in another layout]): the same state as loading
    entries of the parameter's own placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    opts, models = [], []
    gen = torch.Generator().manual_seed(9)
    full = {}
    for name in NAMES:
        shape = v0.SHAPES[name]
        full[name] = {"step": torch.tensor(4.0)}
        for key in STATE_KEYS:
            full[name][key] = torch.rand(shape, generator=gen) * 1e-3
    for form in ("own", "swapped", "plain"):
        model = v0.Net()
        model.transposed.data = model.transposed.data.contiguous()
        fully_shard(model, mesh=mesh)
        opt = ruda_torch.AdamW(model.parameters(), **{**v0.OPTIONS, "state_precision": "fp32"})
        state = {}
        for i, (name, p) in enumerate(model.named_parameters()):
            assert tuple(p.placements) == (Replicate(), Shard(0))
            entry = {"step": full[name]["step"]}
            for key in STATE_KEYS:
                value = full[name][key]
                if form == "own":
                    value = distribute_tensor(value, mesh, p.placements, src_data_rank=None)
                elif form == "swapped":
                    value = distribute_tensor(value, mesh, [Shard(0), Replicate()],
                                              src_data_rank=None)  # fmt: skip
                    own = distribute_tensor(full[name][key], mesh, p.placements,
                                            src_data_rank=None).to_local()  # fmt: skip
                    # The fact the test is about: on ranks (0, 1) and (1, 0) the local
                    # shards have one shape and other elements.
                    if rank in (1, 2) and own.numel():
                        assert own.shape == value.to_local().shape
                        assert not torch.equal(own, value.to_local()), name
                entry[key] = value
            state[i] = entry
        opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
        v0.feed(model, 0)
        opt.step()
        opts.append(opt)
        models.append(model)
    want = full_state(models[0], opts[0])
    for k in (1, 2):
        assert_same_state(full_state(models[k], opts[k]), want, ("swapped", "plain")[k - 1])


@distributed
def test_entries_in_other_placements_load_as_their_values(tmp_path):
    run_scenario(tmp_path, "test_state_8bit_migration:scenario_other_placements", world=4)
