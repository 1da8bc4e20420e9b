"""Checkpoints: sharded DCP checkpoints that resume exactly and reshard (``dcp``), where they
are and what ``meta.json`` says, the checkpoint format included (``meta``), their checksums
(``integrity``), DCP reads that unpickle nothing else (``safe_read``), the resume check
(``compat``), the ``checkpoint:`` section (``config``), the run directory's rules and lock
(``run_dir``), save/load for your own loop (``loop``), and the unsharded model state gathered
in memory, what a checkpoint of it would hold (``gather``: publishing without reading one
back), and a rank's random state, CPU and CUDA generators (``rng``). Sits under ``train`` (the Trainer saves and resumes); nothing is re-exported here."""
