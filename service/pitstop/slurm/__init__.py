"""pitstop and Slurm: a drained node's ranks moved by themselves (`pitstop slurm-watch`)."""
