"""The handlers of `reroll`'s own commands, a module per area. `reroll.cli`'s table names each
command's `configure` function by import path, so a command's module (and what it imports:
torch, transformers) loads only when that command runs."""
