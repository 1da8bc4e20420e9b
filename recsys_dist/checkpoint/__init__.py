"""Checkpoints: sharded DCP checkpoints that resume exactly and reshard (``dcp``), where they
are and what ``meta.json`` says, the checkpoint format included (``meta``), their checksums
(``integrity``), DCP reads that unpickle nothing else (``safe_read``), the resume check
(``compat``), the ``checkpoint:`` section (``config``), the run directory's rules and lock
(``run_dir``), and save/load for your own loop (``loop``). Sits under ``train`` (the Trainer
saves and resumes); nothing is re-exported here."""
