"""Train a small causal transformer with FSDP and ruda_torch.AdamW, with DCP checkpoints.

The data needs no download: token sequences drawn from a fixed random Markov chain, which
the model learns to predict (the loss falls towards the chain's entropy). Every step's
global batch is generated from (seed, step), each rank takes its slice, so a resumed run
sees exactly the batches an uninterrupted one would.

    torchrun --nproc_per_node=2 examples/fsdp_train.py                  # FSDP2 (fully_shard)
    torchrun --nproc_per_node=2 examples/fsdp_train.py --fsdp1          # FSDP1 (FlatParameter)
    torchrun --nproc_per_node=2 examples/fsdp_train.py --steps 60 --save-at 30
    torchrun --nproc_per_node=2 examples/fsdp_train.py --steps 60 --resume
    torchrun --nproc_per_node=2 examples/fsdp_train.py --state-precision 8bit  # 8-bit moments
    python examples/fsdp_train.py                                       # one process

The backend is NCCL on GPUs (one per rank) when CUDA is available, gloo on the CPU
otherwise (--device cpu forces the CPU). The optimizer is

    ruda_torch.AdamW(..., fused_step=True, hierarchical_stats=True, max_grad_norm=1.0,
                     process_group=<the FSDP1 process group; None for FSDP2>,
                     state_precision=<--state-precision: fp32, bf16 or 8bit>)

so the gradient norm is global across ranks and clipping happens inside the step. The loss
and the gradient norm (``optimizer.last_report``) are read on the host only every
--log-every steps. --save-at N [N ...] writes a sharded torch.distributed.checkpoint (DCP)
directory <ckpt-dir>/step_<N>; --resume loads the newest one and continues. The run ends
by printing a checksum of the parameters (the same bits on every rank), so that an
uninterrupted run and a resumed one can be compared: with the same options they print the
same checksum. See docs/fsdp.md.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

try:
    import ruda_torch
except ImportError:
    print(
        "error: cannot import ruda_torch; build it first (`make build`, or "
        "`pip install --no-build-isolation -e .` in the repository root)",
        file=sys.stderr,
    )
    raise


# torch's own deprecation chatter from inside FSDP1 and DCP, printed by every rank.
for _message in (
    r"`_get_pg_default_device` will be deprecated",
    r"Multiple backends are registered with this ProcessGroup",
    r"FSDP.state_dict_type\(\) and FSDP.set_state_dict_type\(\) are being deprecated",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
):
    warnings.filterwarnings("ignore", message=_message)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fsdp1", action="store_true", help="FSDP1 instead of FSDP2 (fully_shard)")
    p.add_argument("--use-orig-params", action="store_true", help="FSDP1 with use_orig_params=True")
    p.add_argument("--steps", type=int, default=100, help="total optimizer steps (default 100)")
    p.add_argument("--batch", type=int, default=32, help="global batch, sequences (default 32)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size (default 64)")
    p.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    p.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="global-norm clipping (default 1.0)"
    )
    p.add_argument("--log-every", type=int, default=10, help="log interval (default 10)")
    p.add_argument("--seed", type=int, default=0, help="seed of data and weights (default 0)")
    p.add_argument(
        "--save-at",
        type=int,
        nargs="*",
        default=[],
        metavar="STEP",
        help="save a DCP checkpoint after these steps",
    )
    p.add_argument(
        "--ckpt-dir",
        default="checkpoints/fsdp_train",
        help="checkpoint folder (default checkpoints/fsdp_train)",
    )
    p.add_argument(
        "--resume", action="store_true", help="load the newest checkpoint in --ckpt-dir first"
    )
    p.add_argument(
        "--state-precision",
        choices=("fp32", "bf16", "8bit"),
        default="fp32",
        help="how the optimizer stores its moments (docs/usage.md; default fp32)",
    )
    p.add_argument(
        "--min-8bit-size",
        type=int,
        default=4096,
        help="with --state-precision 8bit, parameters with fewer elements keep FP32 "
        "moments (default 4096)",
    )
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto"
    )
    args = p.parse_args(argv)
    if min(args.steps, args.batch, args.seq_len, args.log_every, args.layers) < 1:
        p.error("--steps, --batch, --seq-len, --log-every and --layers must be positive")
    if args.d_model % args.heads:
        p.error("--d-model must be a multiple of --heads")
    if args.use_orig_params and not args.fsdp1:
        p.error("--use-orig-params is an FSDP1 option: add --fsdp1")
    if args.min_8bit_size < 0:
        p.error("--min-8bit-size must be non-negative")
    return args


# --------------------------------------------------------------------------- distributed


def init_distributed(choice: str) -> tuple[torch.device, bool]:
    """Join the process group torchrun describes (or a group of one without torchrun);
    returns (device, whether this call created the group). A group that already exists
    (a test harness, a notebook) is used as it is."""
    use_cuda = choice == "cuda" or (choice == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch.cuda.is_available() is False")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return device, False
    if "RANK" not in os.environ:  # plain `python examples/fsdp_train.py`
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    return device, True


def log(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


# --------------------------------------------------------------------------- model, data


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq_len, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy of ``tokens`` ([batch, seq_len + 1])."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.embed(inputs) + self.pos[: inputs.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class MarkovData:
    """Sequences from a fixed random first-order Markov chain over the vocabulary."""

    def __init__(self, vocab: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.transitions = torch.softmax(3.0 * torch.randn(vocab, vocab, generator=gen), dim=1)
        self.seed = seed
        # Entropy rate of the chain (nats): the loss a perfect model reaches.
        stationary = torch.full((vocab,), 1.0 / vocab)
        for _ in range(200):
            stationary = stationary @ self.transitions
        row_entropy = -(self.transitions * self.transitions.log()).sum(1)
        self.entropy = float(stationary @ row_entropy)

    def global_batch(self, step: int, batch: int, seq_len: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        vocab = self.transitions.shape[0]
        tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for t in range(seq_len):
            tokens[:, t + 1] = torch.multinomial(
                self.transitions[tokens[:, t]], 1, generator=gen
            ).squeeze(1)
        return tokens


def shard_model(model: nn.Module, args, device: torch.device):
    """Wrap ``model`` with FSDP1 or FSDP2; returns (model, process_group for the optimizer)."""
    if args.fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=device,
            use_orig_params=args.use_orig_params,
        )
        # FSDP1's flat-parameter shards are plain tensors: the optimizer must be told the
        # group they are sharded over, or its gradient norm would be only this rank's.
        return model, model.process_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # FSDP2 parameters are DTensors: the optimizer takes the groups from their mesh.
    return model, None


# --------------------------------------------------------------------------- checkpoints


def checkpoint_path(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step_{step}")


def newest_checkpoint(ckpt_dir: str) -> tuple[str, int] | None:
    found = []
    if os.path.isdir(ckpt_dir):
        for name in os.listdir(ckpt_dir):
            m = re.fullmatch(r"step_(\d+)", name)
            if m and os.path.exists(os.path.join(ckpt_dir, name, ".metadata")):
                found.append(int(m.group(1)))
    if not found:
        return None
    return checkpoint_path(ckpt_dir, max(found)), max(found)


def save_checkpoint(model, optimizer, step: int, ckpt_dir: str) -> str:
    """A sharded DCP checkpoint: every rank writes its own shards."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    path = checkpoint_path(ckpt_dir, step)
    state = {"model": model_sd, "optim": optim_sd, "trainer": {"step": torch.tensor(step)}}
    dcp.save(state, checkpoint_id=path)
    return path


def load_checkpoint(model, optimizer, path: str) -> int:
    """Load into a freshly built model and optimizer; returns the step to continue from.
    get_state_dict materializes the optimizer's state (one step with zero gradients and
    lr=0, which leaves the parameters bit-identical) so that DCP has tensors to load into."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "trainer": {"step": torch.tensor(0)}}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return int(state["trainer"]["step"])


# --------------------------------------------------------------------------- training


@torch.no_grad()
def parameter_checksum(model, device: torch.device) -> tuple[float, str]:
    """Sum of squares of every parameter element, global across ranks: (value, hex of
    its FP64 bits). FP64 accumulation of FP32 squares of the local shards, summed over
    ranks; the same on every rank."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.double().square().sum()
    if dist.get_world_size() > 1:
        dist.all_reduce(total)  # FSDP1/FSDP2 shards are disjoint (padding is zero)
    value = total.item()
    return value, value.hex()


def main(argv=None) -> float:
    """Train; returns the final parameter checksum (see parameter_checksum)."""
    args = parse_args(argv)
    device, owns_group = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"error: --batch {args.batch} is not divisible by {world} ranks")
    local_batch = args.batch // world

    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.d_model, args.heads, args.layers, args.seq_len).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    model, process_group = shard_model(model, args, device)
    optimizer = ruda_torch.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        fused_step=True,
        hierarchical_stats=True,
        max_grad_norm=args.max_grad_norm,
        process_group=process_group,
        state_precision=args.state_precision,
        min_8bit_size=args.min_8bit_size,
    )
    data = MarkovData(args.vocab, args.seed)

    kind = (
        f"FSDP1 (use_orig_params={args.use_orig_params})" if args.fsdp1 else "FSDP2 (fully_shard)"
    )
    log(
        f"{kind}, {world} rank(s), backend {dist.get_backend()}, device {device.type}; "
        f"TinyLM with {n_params:,} parameters ({args.layers} blocks, d_model {args.d_model}, "
        f"vocab {args.vocab}); global batch {args.batch} x {args.seq_len} tokens"
    )
    log(
        f"ruda_torch.AdamW(lr={args.lr:g}, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, "
        f"fused_step=True, hierarchical_stats=True, max_grad_norm={args.max_grad_norm:g}, "
        f"process_group={'the FSDP1 group' if process_group is not None else 'None'}, "
        f"state_precision={args.state_precision!r}); "
        f"the chain's entropy (best reachable loss) is {data.entropy:.4f}"
    )

    start = 0
    if args.resume:
        found = newest_checkpoint(args.ckpt_dir)
        if found is None:
            raise SystemExit(f"error: --resume: no checkpoint step_<N> in {args.ckpt_dir}")
        start = load_checkpoint(model, optimizer, found[0])
        log(f"resumed from {found[0]} at step {start}")
    if start >= args.steps:
        log(f"nothing to do: the checkpoint is at step {start}, --steps is {args.steps}")

    header = " | ".join(
        f"{name:>{width}}"
        for name, width in (
            ("step", 6),
            ("loss", 8),
            ("grad norm", 9),
            ("clip coef", 9),
            ("skipped", 7),
            ("ms/step", 8),
        )
    )
    log(header)
    log("-" * len(header))
    loss_sum = torch.zeros((), device=device)
    skipped = torch.zeros((), device=device)
    since, tick = 0, time.perf_counter()
    for step in range(start, args.steps):
        tokens = data.global_batch(step, args.batch, args.seq_len)
        tokens = tokens[rank * local_batch : (rank + 1) * local_batch].to(device)
        loss = model(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Device-side bookkeeping only: no host sync until the log line.
        loss_sum += loss.detach()
        report = optimizer.last_report
        skipped += report.skipped
        since += 1
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            mean_loss = loss_sum / since
            if world > 1:
                dist.all_reduce(mean_loss)  # the mean of the ranks' local losses
                mean_loss /= world
            ms = 1e3 * (time.perf_counter() - tick) / since
            log(
                f"{done:>6} | {mean_loss.item():>8.4f} | {report.grad_norm.item():>9.4f} | "
                f"{report.clip_coef.item():>9.4f} | {int(skipped.item()):>7} | {ms:>8.1f}"
            )
            loss_sum.zero_()
            since, tick = 0, time.perf_counter()
        if done in args.save_at:
            path = save_checkpoint(model, optimizer, done, args.ckpt_dir)
            log(f"saved checkpoint {path}")

    value, bits = parameter_checksum(model, device)
    log(f"final parameter checksum (sum of squares): {value:.10g} [{bits}]")
    if owns_group:
        dist.destroy_process_group()
    if not math.isfinite(value):
        raise SystemExit("error: parameters are not finite")
    return value


if __name__ == "__main__":
    main()
