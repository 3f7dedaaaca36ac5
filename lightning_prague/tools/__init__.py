"""Benchmark and planning tools: never imported by the training runtime.

* `runtime_model` - predicts each strategy's throughput on a cluster from step times and links;
* `plan` - `lightning-prague plan`: the prediction as a table;
* `bench` - `lightning-prague bench`: every strategy against DDP under slowdown profiles;
* `cluster_bench` - `bench --cluster`: the same on an emulated cluster with shaped links;
* `cluster` - the emulated cluster (network namespaces, a bridge, ``tc``; needs root);
"""
