"""The control plane: runs in the supervisor process only (one per job, on the first node).

Global rank 0 starts the supervisor at set-up (`launch`); from then on it hosts the job's store
and serves every training process's connection. Everything that coordinates ranks is decided
here, in one event loop and one global order:

* `supervisor` - the process's entry point: the store, the server, when to exit;
* `server` - `MessageServer`, the connections (one per training process), lines in, items out;
* `coordinator` - `ControlPlane`: the sessions (one per fit), membership, meetings, counters;
* `generator` - `GroupGenerator`: who averages with whom next, from a `grouping` policy;
* `liveness` - `HangDetector`: the verdict on a worker's beats (hung, or only slow);
* `launch` - the launching process's side: start the supervisor, wait until it listens.

It imports the wire contract (`lightning_prague.core.protocol`) and the pure grouping logic
(`lightning_prague.core.grouping`), never the client, the data plane or the exchanges.
"""
