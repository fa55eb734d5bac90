"""Tensor parallelism: which share of a model each rank computes (:mod:`.sharding`) and
the group of rank processes that compute it together (:mod:`.group`)."""
