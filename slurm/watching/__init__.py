"""What a launch and a user see of a plan: states from the queue and the run folders, log tails, GPU
usage, the tables. Imports the wings below it (cluster/, planning/) and core/.
"""
