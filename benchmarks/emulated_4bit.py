"""The 4-bit moments' format emulated in Python, its codes rounded to nearest or stochastically.

A study of the codes' rounding (docs/performance.md, "The second moment's drift"), not a
second implementation: the kernels round to nearest (Note [4-bit moments] in
csrc/quant4.h); this optimizer does what they do with torch operations, so that another
rounding can be tried in training before it is built into the shared math.

A step is AdamW in FP32 on the moments decoded from their codes, then the moments coded
again: blocks of 128 consecutive elements of each row, each block's scale its largest
magnitude, exp_avg by sign + E2M1 (magnitudes 0, 1/12, 1/6, 1/4, 1/3, 1/2, 2/3, 1 of the
scale), exp_avg_sq by E2M2 without zero (k/28 for k = 1..8, 10, 12, 14, 16, 20, 24, 28: a
positive value below 1/28 codes as 1/28); tensors of fewer than 4096 elements keep FP32
moments. Rounding:

  nearest     the nearer code (the kernels' rule; ties and the FP32 quotient aside, so the
              same drift as the kernels, not their bits);
  stochastic  the code above with probability (y - below) / (above - below), else the one
              below: the coded value is the exact one on average.

The state holds the decoded moments (FP32) under torch's names.
"""

from __future__ import annotations

import torch

BLOCK = 128
MIN_SIZE = 4096
ROUNDINGS = ("nearest", "stochastic")

_E2M1 = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12], dtype=torch.float32) / 12
SIGNED = torch.cat([-_E2M1.flip(0)[:-1], _E2M1])  # 15 values, -1 .. 1
UNSIGNED = torch.tensor([*range(1, 9), 10, 12, 14, 16, 20, 24, 28], dtype=torch.float32) / 28


def code(
    x: torch.Tensor, table: torch.Tensor, rounding: str, gen: torch.Generator | None = None
) -> torch.Tensor:
    """x coded by `table` in blocks of BLOCK elements of each row (a 0-D or 1-D tensor is one
    row), and decoded. An exact zero stays zero (exp_avg_sq's code 0)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    rows = x.reshape(x.shape[0] if x.dim() >= 2 else 1, -1)
    n = rows.shape[1]
    blocks = torch.cat([rows, rows.new_zeros(rows.shape[0], -n % BLOCK)], 1)
    blocks = blocks.view(rows.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(2, keepdim=True)
    y = (blocks / torch.where(scale > 0, scale, 1.0)).clamp(table[0].item(), 1.0)
    i = torch.bucketize(y, table).clamp(1, len(table) - 1)  # table[i - 1] < y <= table[i]
    below, above = table[i - 1], table[i]
    if rounding == "nearest":
        out = torch.where(y - below < above - y, below, above)
    else:
        u = torch.rand(y.shape, generator=gen)
        out = torch.where(u * (above - below) < y - below, above, below)
    out = torch.where(y <= table[0], table[0], out)
    out = torch.where(blocks == 0, 0.0, out)
    return (out * scale).view(rows.shape[0], -1)[:, :n].reshape(x.shape)


class Emulated4bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) on moments kept as the 4-bit codes would keep them."""

    def __init__(self, params, lr, betas, eps, weight_decay, *, rounding_exp_avg="nearest",
                 rounding_exp_avg_sq="nearest", seed=1):  # fmt: skip
        for name, r in (("rounding_exp_avg", rounding_exp_avg),
                        ("rounding_exp_avg_sq", rounding_exp_avg_sq)):  # fmt: skip
            if r not in ROUNDINGS:
                raise ValueError(f"Emulated4bit: {name} must be one of {ROUNDINGS}, got {r!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.rounding = (rounding_exp_avg, rounding_exp_avg_sq)
        self.gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr = float(group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"]
                g = p.grad.float()
                m = state["exp_avg"].mul(b1).add_(g, alpha=1 - b1)
                v = state["exp_avg_sq"].mul(b2).addcmul_(g, g, value=1 - b2)
                denom = (v / (1 - b2**t)).sqrt_().add_(group["eps"])
                p.mul_(1 - lr * group["weight_decay"])
                p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-lr / (1 - b1**t))
                if p.numel() >= MIN_SIZE:
                    m = code(m, SIGNED, self.rounding[0], self.gen)
                    v = code(v, UNSIGNED, self.rounding[1], self.gen)
                state["exp_avg"], state["exp_avg_sq"] = m, v
        return loss
