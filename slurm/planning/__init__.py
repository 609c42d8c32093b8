"""From experiment YAMLs to a plan: loading and checking them, estimates, the plan's jobs, packing and
preflight. Pure data; imports only core/ and slurm/cluster/.
"""
