"""Replica groups: consecutive ranks that hold one model between them and decentralize as one unit.

`layout` maps replicas to ranks (no torch); `columns` turns a schedule drawn over replicas into the
ranks' schedule; `slices` averages the models of several replicas, rank
`i` of each with rank `i` of the others on its own slice of the model, or, for a model sharded over
each replica's ranks, on its own shards.
"""

from lightning_prague.core.replicas.columns import column_schedule
from lightning_prague.core.replicas.layout import NODE, ReplicaLayout
from lightning_prague.core.replicas.slices import average_replicas_by_slices, average_sharded_replicas

__all__ = ["NODE", "ReplicaLayout", "column_schedule", "average_replicas_by_slices", "average_sharded_replicas"]
