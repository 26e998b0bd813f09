"""Generate fixtures/pytorch_fixtures.json with real CPU torch.optim.AdamW.

    python tools/make_fixtures.py           # regenerate in memory; exit 1 if the
                                            # committed file differs from it
    python tools/make_fixtures.py --write   # rewrite the committed file

The file holds 12 cases (gradient dtype float32 / float16 / bfloat16 x AMSGrad off/on x
maximize off/on), 5 steps each, on a 97-element parameter (not a multiple of any SIMD
width, so kernels run their leftover loop). Every hyperparameter is non-default and
every term of the update matters: lr=1e-2, betas=(0.8, 0.95), eps=1e-6 (comparable to
the update of the tiny gradients), weight_decay=0.1. Gradients span 1e-8..1e2 in
magnitude, include an exact zero per step, and in FP16 reach the subnormal range.

torch requires grad.dtype == param.dtype, so an FP16/BF16 case draws its gradient in
that dtype and hands torch the exact FP32 conversion; the JSON records the gradient
dtype and the (exactly representable) gradient values. torch runs its single-tensor
path (foreach=False, fused=False) in FP32.

Every float is written with Python's shortest round-trip repr, so parsing the JSON
gives back the exact FP32 (or FP16/BF16) values. torch's CPU kernels may round
differently under another torch version or SIMD capability: the generator block
records both, and the freshness test runs only where they match.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

FORMAT_VERSION = 1
SCRIPT = "tools/make_fixtures.py"
FIXTURE_PATH = Path(__file__).resolve().parent.parent / "fixtures" / "pytorch_fixtures.json"

NUMEL = 97
STEPS = 5
HYPERPARAMETERS = {"lr": 1e-2, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
GRAD_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Gradient magnitudes are 10**U(LOG10_MIN, LOG10_MAX) times a standard normal sample.
LOG10_MIN = -8.0
LOG10_MAX = 2.0
BASE_SEED = 1_000


def case_name(grad_dtype: str, amsgrad: bool, maximize: bool) -> str:
    return f"{grad_dtype}-{'amsgrad' if amsgrad else 'adamw'}-{'max' if maximize else 'min'}"


def _gradient(generator: torch.Generator, step: int, dtype: torch.dtype) -> torch.Tensor:
    sign_and_shape = torch.randn(NUMEL, generator=generator, dtype=torch.float32)
    log10 = torch.empty(NUMEL, dtype=torch.float32).uniform_(
        LOG10_MIN, LOG10_MAX, generator=generator
    )
    grad = sign_and_shape * torch.pow(10.0, log10)
    grad[(17 * step) % NUMEL] = 0.0
    return grad.to(dtype)


def _values(tensor: torch.Tensor) -> list[float]:
    # .tolist() gives Python floats holding the exact stored values (FP32, FP16 and
    # BF16 are subsets of FP64), and json writes their shortest round-trip repr.
    return tensor.detach().reshape(-1).tolist()


def _run_case(index: int, grad_dtype: str, amsgrad: bool, maximize: bool) -> dict:
    seed = BASE_SEED + index
    generator = torch.Generator().manual_seed(seed)
    initial = torch.randn(NUMEL, generator=generator, dtype=torch.float32)
    param = torch.nn.Parameter(initial.clone())
    optimizer = torch.optim.AdamW(
        [param],
        lr=HYPERPARAMETERS["lr"],
        betas=tuple(HYPERPARAMETERS["betas"]),
        eps=HYPERPARAMETERS["eps"],
        weight_decay=HYPERPARAMETERS["weight_decay"],
        amsgrad=amsgrad,
        maximize=maximize,
        foreach=False,
        fused=False,
    )
    steps = []
    for step in range(1, STEPS + 1):
        grad = _gradient(generator, step, GRAD_DTYPES[grad_dtype])
        param.grad = grad.to(torch.float32)  # exact: every FP16/BF16 value is an FP32 value
        optimizer.step()
        state = optimizer.state[param]
        count = state["step"].item()
        if count != step:
            raise RuntimeError(f"torch's step counter is {count} after step {step}")
        record = {
            "step": step,
            "grad": _values(grad),
            "param": _values(param),
            "exp_avg": _values(state["exp_avg"]),
            "exp_avg_sq": _values(state["exp_avg_sq"]),
        }
        if amsgrad:
            record["max_exp_avg_sq"] = _values(state["max_exp_avg_sq"])
        steps.append(record)
    return {
        "name": case_name(grad_dtype, amsgrad, maximize),
        "seed": seed,
        "grad_dtype": grad_dtype,
        "hyperparameters": {**HYPERPARAMETERS, "amsgrad": amsgrad, "maximize": maximize},
        "initial_param": _values(initial),
        "steps": steps,
    }


def build_fixtures() -> dict:
    """The fixture document, regenerated in memory."""
    cases = []
    for grad_dtype in GRAD_DTYPES:
        for amsgrad in (False, True):
            for maximize in (False, True):
                cases.append(_run_case(len(cases), grad_dtype, amsgrad, maximize))
    return {
        "format_version": FORMAT_VERSION,
        "description": (
            "Expected FP32 parameters and moments after each step of CPU "
            "torch.optim.AdamW(foreach=False, fused=False). 'step' is the step count "
            "after the step; 'grad' holds the gradient values in 'grad_dtype', which "
            "torch received converted exactly to FP32."
        ),
        "generator": {
            "script": SCRIPT,
            "command": f"python {SCRIPT} --write",
            "torch_version": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        },
        "numel": NUMEL,
        "steps_per_case": STEPS,
        "cases": cases,
    }


def _dumps(value: object, indent: int = 0) -> str:
    # Containers one entry per line, but each list of numbers on a single line, which
    # keeps the file small and its diffs readable.
    pad = "  " * (indent + 1)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: {_dumps(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * indent + "}"
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        items = [pad + _dumps(v, indent + 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + "  " * indent + "]"
    return json.dumps(value, allow_nan=False)


def render(document: dict) -> str:
    return _dumps(document) + "\n"


def load_fixtures(path: Path = FIXTURE_PATH) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _first_difference(expected: object, actual: object, where: str = "$") -> str | None:
    if type(expected) is not type(actual):
        return f"{where}: {type(actual).__name__} in the file, {type(expected).__name__} now"
    if isinstance(expected, dict):
        if expected.keys() != actual.keys():
            return f"{where}: keys {sorted(actual)} in the file, {sorted(expected)} now"
        for key in expected:
            found = _first_difference(expected[key], actual[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(expected, list):
        if len(expected) != len(actual):
            return f"{where}: {len(actual)} entries in the file, {len(expected)} now"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            found = _first_difference(e, a, f"{where}[{i}]")
            if found:
                return found
        return None
    if expected != actual:
        return f"{where}: {actual!r} in the file, {expected!r} now"
    return None


def check(path: Path = FIXTURE_PATH) -> str | None:
    """None if the file at `path` equals a fresh regeneration, else the first difference."""
    if not path.exists():
        return f"{path.name} does not exist"
    # Compare parsed documents rather than bytes, so that line endings do not matter.
    return _first_difference(json.loads(render(build_fixtures())), load_fixtures(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help="rewrite the fixture file (default: only check it)"
    )
    args = parser.parse_args(argv)
    relative = FIXTURE_PATH.relative_to(FIXTURE_PATH.parent.parent)
    if args.write:
        text = render(build_fixtures())
        FIXTURE_PATH.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {relative} ({len(text.encode())} bytes, torch {torch.__version__})")
        return 0
    difference = check()
    if difference is None:
        print(f"{relative} is up to date (torch {torch.__version__})")
        return 0
    print(f"{relative} is out of date: {difference}")
    print(f"regenerate it with: python {SCRIPT} --write")
    return 1


if __name__ == "__main__":
    sys.exit(main())
