"""Distributed: the process group (``env``), TorchRec sharders and the one planning path
(``sharding``), the plan dry run (``dry_run``), table initialisation and state moves (``tables``),
the fused embedding optimizer (``optim``), and the bytes on the wire (``ledger``, ``comm_counter``).
Imports data and models; nothing is re-exported here."""
