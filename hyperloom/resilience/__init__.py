"""Training that heals itself: anomaly detection, recovery, watchdog, restarts, drills.

`anomaly` (NaN/Inf and spikes in loss and grad norm), `policy` (skip, rollback, stop, and when
to give up), `watchdog` (hangs and restart loops), `launch` (`hyperloom train --nproc N`,
restarted whole), `lock` (one job per run directory, no process outliving its job), `inject`
and `drill` (fault injection and `hyperloom drill`), `guard` (the hooks the trainer calls) and
`events` (events.log and metrics.jsonl records). Checkpoints live in hyperloom.checkpoint;
resilience uses its interface.
"""
