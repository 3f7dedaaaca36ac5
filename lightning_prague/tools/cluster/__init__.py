"""An emulated cluster on one machine (network namespaces, a bridge, ``tc`` shaping): see `emulate`."""

from .emulate import (
    PREFIX,
    Cluster,
    ClusterError,
    ClusterUnavailable,
    Node,
    clean_environment,
    cleanup,
    unavailable_reason,
)

__all__ = [
    "PREFIX",
    "Cluster",
    "ClusterError",
    "ClusterUnavailable",
    "Node",
    "clean_environment",
    "cleanup",
    "unavailable_reason",
]
