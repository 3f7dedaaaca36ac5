#!/usr/bin/env bash
# torchrun: run this on every node of the job (4 nodes x 8 GPUs by default), each with the same
# MASTER_ADDR, the host of the rendezvous (the first node, say).
#
#   MASTER_ADDR=node0.example.org bash examples/cluster/torchrun.sh            # on each node
#   MASTER_ADDR=node0.example.org NNODES=2 NPROC_PER_NODE=4 bash examples/cluster/torchrun.sh --strategy adpsgd
#
# Lightning's TorchElasticEnvironment takes the ranks from torchrun. The workers use the store of
# the rendezvous host's agent; the control plane runs on the node of global rank 0.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to the rendezvous host, the same on every node}"
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${NNODES:-4}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
JOB_ID=${JOB_ID:-prague-digits}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT_DIR=${ROOT_DIR:-$PWD/runs/$JOB_ID}

# The interface the nodes reach each other on, for gloo's and NCCL's own connections.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-eth0}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}
# A fixed port for the control plane (on the node of global rank 0), to open in a firewall.
export LIGHTNING_PRAGUE_CONTROL_PORT=${LIGHTNING_PRAGUE_CONTROL_PORT:-29501}
# Where the job's store and control plane run: by default on the node of global rank 0, and the job
# ends if that node is lost. On preemptible nodes, run them as a service on a host that is not
# (lightning-prague plane; docs/fault_tolerance.md, The control plane as a service) and set its
# address and the secret it was started with on every node:
#   LIGHTNING_PRAGUE_PLANE=planehost:29400 LIGHTNING_PRAGUE_SECRET_FILE=/shared/prague-secret bash torchrun.sh
# (the workers then meet in its store; torchrun's own rendezvous stays at MASTER_ADDR).
if [ -n "${LIGHTNING_PRAGUE_PLANE:-}" ] && [ -z "${LIGHTNING_PRAGUE_SECRET:-}${LIGHTNING_PRAGUE_SECRET_FILE:-}" ]; then
    echo "LIGHTNING_PRAGUE_PLANE=$LIGHTNING_PRAGUE_PLANE: set the plane's secret too (LIGHTNING_PRAGUE_SECRET_FILE)" >&2
    exit 2
fi
# The job's secret, the same on every node (torchrun passes the variable to its workers). Without
# one, rank 0 generates it and hands it out through the job's store, which anyone who reaches the
# store can read (docs/security.md, The secret). One per job id, in a file only you can read in
# ROOT_DIR, which must be on a file system every node shares: the first node to get here writes it.
if [ -z "${LIGHTNING_PRAGUE_SECRET:-}${LIGHTNING_PRAGUE_SECRET_FILE:-}" ]; then
    mkdir -p "$ROOT_DIR"
    export LIGHTNING_PRAGUE_SECRET_FILE="$ROOT_DIR/.secret-$JOB_ID"
    (umask 077 && set -C && head -c 32 /dev/urandom | base64 > "$LIGHTNING_PRAGUE_SECRET_FILE") 2> /dev/null || true
fi

# --max-restarts 0: torchrun's own restart restarts every worker of a node and cannot heal a job of
# several nodes (docs/multi_node.md, Exit statuses and the job's status). The library restarts a lost
# worker instead: train.py's --max-restarts (3 by default) makes each worker the keeper of its training
# process, which it starts again in place when it dies (a crash, kill -9, an out-of-memory kill); the
# new process rejoins the running fit and torchrun's agent sees nothing. A rank the control plane
# excludes, because it hung, exits 0, so its agent keeps the node's other workers and the job
# SUCCEEDED when the others finished the fit.
exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$JOB_ID" --max-restarts 0 \
    "$HERE/train.py" --num-nodes "$NNODES" --devices "$NPROC_PER_NODE" --root-dir "$ROOT_DIR" "$@"
