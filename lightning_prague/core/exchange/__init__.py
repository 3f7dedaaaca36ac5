"""Exchanges: how a training process averages with its groups, in every training process.

* `worker` - `GroupWorker`: asks the control plane for a group, averages with it, meets the others;
* `overlap` - `Exchanger`s: blocking, overlapped with the next steps, or in the background;
* `gossip` - gossip rounds on a schedule (decentralized Adam, Prague's static grouping);
* `phases` - `SyncController`: a rank's phase between synchronization points;
* `training` - `TrainingSession`: one fit's control session, worker and exchanger together.

Built on the client (`lightning_prague.core.client`) and the data plane (`lightning_prague.core.comm`).
"""
