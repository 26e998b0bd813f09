"""ruda_torch in trainers that need more than the drop-in optimizer: one module per trainer,
each importing its trainer when it is imported itself (``import ruda_torch`` imports none of
them). docs/integrations.md has the recipes.

- ``ruda_torch.integrations.torchtitan``: torchtitan by one flag,
  ``--override.imports ruda_torch.integrations.torchtitan.adamw``.
"""
