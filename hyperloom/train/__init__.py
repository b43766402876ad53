"""The training loop and what it needs: optimizer, LR schedules, checkpoints, reporting."""
