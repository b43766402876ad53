"""Training that heals itself: anomaly detection, recovery, watchdog, restarts, drills.

- `anomaly`: NaN/Inf and spike detection on (loss, grad norm);
- `policy`: skip / rollback to the last stable checkpoint / stop, and when to give up;
- `watchdog`: hang watchdog and restart-loop guard for restarted process groups;
- `inject`, `drill`: fault injection and `hyperloom drill`;
- `guard`: the few hooks the trainer calls (`Guard`), and what it needs of the run
  (`GuardedRun`); `events`: events.log and metrics.jsonl records.

Checkpoints themselves (formats, commit protocol, async writer) live in hyperloom.checkpoint;
resilience saves and finds them through its interface.
"""
