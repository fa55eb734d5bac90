"""``tandem bench``: the registry, one module per benchmark, their workloads and harness."""
