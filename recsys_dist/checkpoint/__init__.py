"""Checkpoints: sharded DCP checkpoints that resume exactly and reshard (``dcp``), the run
directory's rules and lock (``run_dir``), and save/load for your own loop (``loop``). Sits under
``train`` (the Trainer saves and resumes); nothing is re-exported here."""
