"""Ray Data and Ray Train on the work lists of the torch path (implemented in ``ray_adapter``).

    from spiral_lightning.ray import read_table, train_loader

    rows = read_table("spiral:data/points")  # a ray.data.Dataset of the pinned version
    loader = train_loader("spiral:data/points", batch_size=256)  # inside a Ray Train loop

``train_loader`` gives each Ray Train worker its rank's resumable loader, and
``save_loader_state`` / ``restore_loader_state`` keep every rank's position in the checkpoints
the workers report. Needs the ``ray`` extra.
"""

import ray_adapter
from ray_adapter import *  # noqa: F403  (this alias serves ray_adapter's public names, whatever they are)

__all__ = list(ray_adapter.__all__)
