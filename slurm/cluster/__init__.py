"""What the cluster is and says: the scheduler's commands and their answers, its limits, cluster.yaml,
the local GPUs and where a job's ranks meet. The lowest wing of slurm/: it imports only core/.
"""
