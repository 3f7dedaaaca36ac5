"""Who averages with whom: pure functions and data, no sockets, no tensors, no threads.

* `policies` - the grouping policies the control plane's generator runs (random, buffer,
  division, first ready, static schedules, gossip pairs);
* `topology` - decentralized Adam's and Prague's static schedules (rounds of weighted groups);
* `bipartite` - AD-PSGD's active/passive graph;
* `staleness` - Partial Reduce's staleness-aware weights;
* `syncgraph` - Partial Reduce's mixing window (no worker's model stays isolated).

Used by the control plane (in the supervisor) and by the exchanges (a schedule's rounds); it
imports nothing of the rest of the package but the errors.
"""
