"""Distributed: the process group (``env``); planning (``plan``: the one planning path;
``rules``: what a ``sharding`` section obeys; ``fixed_plan``: tables placed by hand; ``plan_io``:
a plan as rows and back; the plan for any cluster without one is ``recsys_dist.train.dry_run``'s); sharding
(``sharding``: the public ``shard``; ``sharders``: every sharding type on CPU; ``key_order``:
outputs in the unsharded key order; ``ids``: ids outside their table refused); the dense tower's
strategy (``dense``: replicated with DDP, or sharded with FSDP2; ``stages``: cut into pipeline stages; ``two_bw``: PipeDream-2BW's delayed update); table
initialisation and state moves (``tables``); the fused embedding optimizer (``optim``); the bytes
on the wire (``ledger``, ``comm_counter``; the pipeline stages' own: ``pipeline_traffic``); tables sharded in groups and replicated across them (``replicas``); and the ``sharding:`` / ``distributed:`` sections
(``config``). Imports data and models; nothing is re-exported here."""
