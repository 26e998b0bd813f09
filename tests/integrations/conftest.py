"""Integration tests (HF transformers.Trainer, PyTorch Lightning, accelerate), run by
`make test-integrations` with the versions pinned in requirements-integrations.txt. Small
models built from configs on the CPU; nothing is downloaded."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
