"""Which stored rows each training step read, from the record a ``SpiralDataModule(record=...)``
run writes (implemented in ``spiral_lightning.datasets.record``).

    from spiral_lightning.record import rows

    steps = rows("runs/record", steps=range(1000, 1100))  # {step: {rank: [(split, start, end), ...]}}

The command line gives the same: ``spiral-lightning record runs/record --steps 1000:1100``.
"""

from spiral_lightning.datasets.record import rows

__all__ = ["rows"]
