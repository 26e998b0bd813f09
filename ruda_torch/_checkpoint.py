"""State that comes from a checkpoint of another layout: the distributed checkpoint (DCP)
template matched to what a checkpoint holds (``ruda_torch.match_checkpoint``), and state
entries laid out unlike their parameter taken into its layout at adoption."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ._common import CODED_KEYS, MASTER_KEYS, STATE_KEYS, codes_key, local, scales_key
from ._state4bit import FORMAT as FOUR
from ._state8bit import FORMAT as EIGHT
from ._state8bit import accepted_shapes, scales_layouts

# Note [Checkpoint templates]
# DCP loads a checkpoint into the tensors of the state dict it is given, read by name and
# shape, so that template must name and shape every moment as the checkpoint holds it.
# Ours can differ from a checkpoint's in two ways, both of which load_state_dict converts
# once the tensors are read (Note [Entries in another layout]):
# * the form of a moment: values under torch's name (FP32, BF16) or an 8-bit pair
#   (`<moment>_codes`, `<moment>_scales`): another state_precision or min_8bit_size, a
#   checkpoint of torch's AdamW, or a 1-D parameter that is a DTensor on one side (FP32
#   moments: Note [8-bit blocks on every mesh] in ruda_torch/_state8bit.py) and a plain
#   tensor on the other (8-bit). A pair read for a DTensor template is read whole on every
#   rank (Replicate placements; its blocks need not fall on this mesh's shards) and values
#   with the placements of the template's codes;
# * the scales of the first 8-bit format (up to commit bc46cce: one row of scales per
#   shard, blocks in each rank's memory order), which only the mesh they were saved on
#   reads (the same shards): they are read in that layout, with the codes sharded like the
#   parameter, and converted by the rows. A first-format checkpoint of another mesh is
#   refused, naming the entry: load it on the mesh it was saved on and save it again.
# And a checkpoint may lack what the template names, where it comes from another optimizer
# (torch's AdamW: no master, no group options of ours) or other options (no AMSGrad): a
# master in the other form (`master_param` and `master_remainder`) is read in that form; a
# moment or master it holds in no form, a group option it does not hold, and an entry it
# holds none of are left out of the template, and load_state_dict treats them as absent
# (a parameter without state starts afresh, a missing master starts from the parameter, a
# missing AMSGrad maximum from zeros, a missing group option is this optimizer's; a
# missing first or second moment is refused, naming it). Everything else is left as it is,
# and DCP reports what still does not match. The template may be nested as
# get_optimizer_state_dict makes it (``state.<fqn>.<key>``, ``param_groups.<i>.<option>``)
# or flat as torchtitan's (``state.<fqn>.<key>``, ``param_groups.<fqn>.<option>`` as keys
# of one dict).


def match_checkpoint(state_dict: Mapping, checkpoint_id=None, *, storage_reader=None) -> dict:
    """The state dict to hand ``torch.distributed.checkpoint.load`` for a checkpoint whose
    optimizer state may hold moments in another form than this optimizer's, or lack keys it
    names (torch's AdamW's: no master, none of our group options; Note [Checkpoint
    templates] in ruda_torch/_checkpoint.py): ``state_dict`` (as for ``dcp.load``:
    ``{"optim": get_optimizer_state_dict(model, optimizer), ...}``, or torchtitan's flat
    optimizer state dict) with each such entry's tensors replaced by tensors of the
    checkpoint's names and shapes and what the checkpoint does not hold left out; the
    input is not modified. Read the checkpoint with ``dcp.load`` into the result, then
    ``set_optimizer_state_dict`` converts. ``checkpoint_id``: the checkpoint's folder
    (read with ``FileSystemReader``), or ``storage_reader`` to read its metadata."""
    if (checkpoint_id is None) == (storage_reader is None):
        raise ValueError("match_checkpoint: give checkpoint_id or storage_reader (one of them)")
    if not isinstance(state_dict, Mapping):
        raise ValueError(
            "match_checkpoint takes the state dict handed to dcp.load (a dict), got "
            f"{type(state_dict).__name__}"
        )
    if storage_reader is None:
        from torch.distributed.checkpoint import FileSystemReader

        storage_reader = FileSystemReader(checkpoint_id)
    saved = storage_reader.read_metadata().state_dict_metadata
    return _matched(state_dict, "", saved)


def _matched(node: Mapping, prefix: str, saved: dict) -> dict:
    out = {}
    for k, v in node.items():
        if isinstance(v, Mapping):
            out[k] = _matched(v, f"{prefix}{k}.", saved)
        elif k == "param_groups" and isinstance(v, list):
            out[k] = [_matched_group(g, f"{prefix}{k}.{i}.", saved) if isinstance(g, Mapping)
                      else g for i, g in enumerate(v)]  # fmt: skip
        else:
            out[k] = v
    if _is_entry(out):
        return _matched_entry(out, prefix, saved)
    flat = _flat_entries(out)
    if flat:  # torchtitan's flat optimizer state dict
        for fqn, names in flat.items():
            entry = {name: out.pop(f"state.{fqn}.{name}") for name in names}
            for name, value in _matched_entry(entry, f"{prefix}state.{fqn}.", saved).items():
                out[f"state.{fqn}.{name}"] = value
        for k in [k for k in out if k.startswith("param_groups.") and prefix + k not in saved]:
            del out[k]
    state = out.get("state")
    if isinstance(state, dict):  # entries of which the checkpoint holds nothing
        out["state"] = {k: v for k, v in state.items() if not isinstance(v, Mapping) or v}
    return out


# What a state entry holds, by key (Note [Checkpoint templates]).
_ENTRY_KEYS = ("step", *STATE_KEYS, *CODED_KEYS, *MASTER_KEYS)


def _is_entry(node: Mapping) -> bool:
    return any(k in node for k in (*STATE_KEYS, *CODED_KEYS))


def _flat_entries(node: Mapping) -> dict:
    """The entries of a flat optimizer state dict: {fqn: [its keys' names]}."""
    if not any(isinstance(k, str) and k.startswith("param_groups.") for k in node):
        return {}
    entries: dict = {}
    for k in node:
        if isinstance(k, str) and k.startswith("state."):
            fqn, _, name = k[len("state.") :].rpartition(".")
            if fqn and name in _ENTRY_KEYS:
                entries.setdefault(fqn, []).append(name)
    return entries


def _matched_group(group: Mapping, prefix: str, saved: dict) -> dict:
    """A param group of the template without the options the checkpoint does not hold."""
    return {k: v for k, v in group.items() if k == "params" or prefix + k in saved}


def _matched_entry(entry: dict, prefix: str, saved: dict) -> dict:
    """State entry ``entry`` (at DCP key ``prefix``) as the checkpoint holds it; empty
    where the checkpoint holds none of it."""
    entry = dict(entry)
    for key in STATE_KEYS:
        _match_moment(entry, prefix, key, saved)
    _match_master(entry, prefix, saved)
    for k in [k for k in entry if prefix + k not in saved]:
        del entry[k]  # held in no form
    return entry


def _match_master(entry: dict, prefix: str, saved: dict) -> None:
    """A master of the template read in the form the checkpoint holds it in."""
    mine = next((k for k in MASTER_KEYS if k in entry), None)
    theirs = next((k for k in MASTER_KEYS if prefix + k in saved), None)
    if (
        mine is None
        or theirs is None
        or mine == theirs
        or not isinstance(entry[mine], torch.Tensor)
    ):
        return
    entry[theirs] = _like(entry.pop(mine), saved[prefix + theirs].properties.dtype)


def _form(keys, name: str, key: str) -> str | None:
    if name + key in keys:
        return "values"
    if name + codes_key(key) in keys and name + scales_key(key) in keys:
        return "8bit"
    return None


def _match_moment(entry: dict, prefix: str, key: str, saved: dict) -> None:
    """Entry ``entry`` (at DCP key ``prefix``) := moment ``key`` in the checkpoint's form;
    a checkpoint pair whose shapes are no format's (Note [8-bit entry formats] in
    ruda_torch/_state8bit.py) is refused, naming its key."""
    mine, theirs = _form(entry, "", key), _form(saved, prefix, key)
    if mine is None or theirs is None or (mine == theirs == "values"):
        return
    ck, sk = codes_key(key), scales_key(key)
    like = entry[key] if mine == "values" else entry[ck]  # shaped like the parameter
    if not isinstance(like, torch.Tensor):
        return
    if theirs == "values":  # the values, placed like the codes
        md = saved[prefix + key]
        entry[key] = _like(like, md.properties.dtype)
        del entry[ck], entry[sk]
        return
    cmd, smd = saved[prefix + ck], saved[prefix + sk]
    if tuple(cmd.size) != tuple(like.shape) or cmd.properties.dtype != torch.uint8:
        raise ValueError(
            f"match_checkpoint: the checkpoint's {prefix + ck!r} is {cmd.properties.dtype} of "
            f"shape {tuple(cmd.size)}; 8-bit codes of this parameter are uint8 of shape "
            f"{tuple(like.shape)}"
        )
    layouts = scales_layouts(like)
    got = tuple(smd.size)
    fmt = next((f for f, (shape, _, _) in layouts.items() if shape == got), None)
    if fmt is None or smd.properties.dtype != torch.float32:
        raise ValueError(_refused(prefix + sk, smd, like, layouts))
    if fmt == "rows":
        if mine == "8bit":
            return  # the same pair
        codes, scales_t = _whole(like, cmd), _whole(like, smd)  # read whole
    else:
        codes, scales_t = _like(like, torch.uint8), _first_format(like, layouts["first"])
    entry.pop(key, None)
    entry[ck], entry[sk] = codes, scales_t


def _refused(where: str, md, like: torch.Tensor, layouts: dict) -> str:
    """The message for checkpoint scales of no format's shape: a first format of another
    mesh named as such."""
    got = tuple(md.size)
    mesh = getattr(like, "device_mesh", None)
    text = (
        f"match_checkpoint: the checkpoint's {where!r} is {md.properties.dtype} of shape {got}; "
        f"the scales of this parameter's 8-bit codes (shape {tuple(like.shape)}) are float32 "
        f"of shape {accepted_shapes(layouts)}"
    )
    if len(got) >= 2:
        shards = "x".join(map(str, got[:-1]))
        here = ("not sharded" if mesh is None
                else "sharded " + "x".join(map(str, layouts["first"][0][:-1])))  # fmt: skip
        text += (
            f". If it holds the first 8-bit format's scales (one row per shard, blocks of each "
            f"rank's memory order), they were saved on a mesh of {shards} shards, and here the "
            f"parameter is {here}: load it on the mesh it was saved on and save it again (this "
            "release's format loads on any mesh)"
        )
    return text


def _like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zeros of ``dtype`` shaped and placed like ``t``."""
    z = torch.zeros(local(t).shape, dtype=dtype, device=local(t).device)
    if not hasattr(t, "device_mesh"):
        return z
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(z, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())  # fmt: skip


def _whole(like: torch.Tensor, md) -> torch.Tensor:
    """A tensor of the checkpoint's ``md`` read whole on this rank: replicated on
    ``like``'s mesh for a DTensor ``like``."""
    z = torch.zeros(tuple(md.size), dtype=md.properties.dtype, device=local(like).device)
    if not hasattr(like, "device_mesh"):
        return z
    from torch.distributed.tensor import DTensor, Replicate

    mesh = like.device_mesh
    return DTensor.from_local(z, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _first_format(like: torch.Tensor, layout: tuple) -> torch.Tensor:
    """Zero scales of the first 8-bit format as this mesh saved them (Note [Checkpoint
    templates]): ``layout`` from scales_layouts."""
    shape, local_shape, placements = layout
    z = torch.zeros(local_shape, dtype=torch.float32, device=local(like).device)
    if placements is None:
        return z
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(z, like.device_mesh, placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())  # fmt: skip


# Note [Entries in another layout]
# A state entry read from a checkpoint may be laid out unlike its parameter: a DTensor of
# other placements (a pair read whole, Note [Checkpoint templates]; HSDP's placements in
# another order, whose local shards have the same shape and other elements), or a plain
# full tensor for a DTensor parameter. Adoption takes each moment into the parameter's
# layout before it reads local shards: values are redistributed (or, plain, cut into this
# rank's shard); an 8-bit pair is decoded in its own layout first, since its blocks are
# its own shards'. A pair whose codes are placed like the parameter is read as it is (the
# first format's scales have placements of their own). Masters go the same way as values.
def in_layout_of(p: torch.Tensor, entry: Mapping, keys) -> dict:
    """Entry ``entry``'s tensors under ``keys`` as local tensors in ``p``'s layout (Note
    [Entries in another layout]), by key; an 8-bit pair laid out otherwise becomes its
    moment's FP32 values."""
    values, pairs = {}, set()
    for key in keys:
        value = entry.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        found = next(
            ((k, fmt) for k in STATE_KEYS for fmt in (EIGHT, FOUR)
             if key in (fmt.codes_key(k), fmt.scales_key(k))),
            None,
        )  # fmt: skip
        if found is None:
            values[key] = local(_to_layout(value, p))
            continue
        moment, fmt = found
        if (moment, fmt.name) in pairs:
            continue
        pairs.add((moment, fmt.name))
        ck, sk = fmt.codes_key(moment), fmt.scales_key(moment)
        codes, scales = entry.get(ck), entry.get(sk)
        if not isinstance(codes, torch.Tensor) or not isinstance(scales, torch.Tensor):
            continue  # check_state_entry refused it already
        if _same_layout(codes, p):
            values[ck], values[sk] = local(codes), local(scales)
        else:
            values[moment] = local(_to_layout(fmt.decoded(codes, scales, moment), p))
    return values


def _same_layout(t: torch.Tensor, p: torch.Tensor) -> bool:
    if not hasattr(p, "device_mesh"):
        return not hasattr(t, "device_mesh")
    return (
        hasattr(t, "device_mesh")
        and t.device_mesh == p.device_mesh
        and tuple(t.placements) == tuple(p.placements)
    )


def _to_layout(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``t`` (shaped like ``p``) laid out like ``p``."""
    if _same_layout(t, p):
        return t
    if not hasattr(p, "device_mesh"):
        return t.full_tensor()  # a DTensor entry for a plain parameter
    if not hasattr(t, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        # A full tensor that every rank holds: this rank's shard of it, no collective.
        return distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)
    if t.device_mesh != p.device_mesh:
        raise ValueError(
            f"a state tensor on mesh {t.device_mesh} for a parameter on mesh {p.device_mesh}: "
            "load the checkpoint onto the parameter's mesh"
        )
    return t.redistribute(p.device_mesh, p.placements)
