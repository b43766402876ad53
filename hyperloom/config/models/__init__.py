"""The `[model]` section's fields, one group per model family (see hyperloom.config.model)."""
