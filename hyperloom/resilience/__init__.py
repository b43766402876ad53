"""Training that heals itself: anomaly detection, recovery, async checkpoints, watchdog, drills.

- `anomaly`: NaN/Inf and spike detection on (loss, grad norm);
- `policy`: skip / rollback to the last stable checkpoint / stop, and when to give up;
- `checkpoint`: staged, asynchronous saves with the commit protocol of train/checkpoint.py;
- `watchdog`: hang watchdog and restart-loop guard for restarted process groups;
- `inject`, `drill`: fault injection and `hyperloom drill`;
- `guard`: the few hooks the trainer calls; `events`: events.log and metrics.jsonl records.
"""
