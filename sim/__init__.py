"""The WAN emulator and the performance model.

``isthmus.sim`` imports neither ``isthmus.intra`` nor ``isthmus.inter``: it models
networks and costs, not training.
"""
