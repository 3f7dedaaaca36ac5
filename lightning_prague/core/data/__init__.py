"""Data: which batch each training process trains next, in every training process.

* `sharding` - `WorkQueueSampler`: one global work queue, fast workers take more chunks;
* `progress` - `ProgressCounter`: global progress (batches trained by every worker together);
* `progress_loader` - `ProgressLoader`: a DataLoader that claims its batches as it yields them.
* `counters` - `EpochKeys`: the per-epoch counters both keep in the session (names, reads, deletion).

The counters live in the control plane's session; nothing here grows per step.
"""
