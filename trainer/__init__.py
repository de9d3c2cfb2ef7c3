"""The Lachesis trainer (policy updates from batches of scored groups).

The training loop lands with the trainer issue; the package exists so that the
distribution's layout is stable from the start.
"""
