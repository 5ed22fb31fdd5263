"""`nlq train`: the loop (loop.py), its set-up (setup.py) and recipe (optim.py), run dirs
(rundir.py), DDP / FSDP2 and the process group (dist.py), the console, spikes, faults for
the crash tests, init_from and wandb. What inference shares with training (batches,
scoring, checkpoints, the memory estimate, the World of ranks) is nlq/run/."""
