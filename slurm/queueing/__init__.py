"""What runs a plan: the launch's decisions, the backends (SLURM, local), packed lanes and units, the
job's entry on the node, the launch lock and the code snapshot. The top wing, under commands/.
"""
