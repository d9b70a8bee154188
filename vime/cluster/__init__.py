"""Multi-node: the cluster config section, node addresses, the Ray cluster, Slurm jobs."""
