"""Ray Data and Ray Train on the work lists of the torch path (implemented in ``ray_adapter``).

    from spiral_lightning.ray import read_table, train_loader

    rows = read_table("spiral:data/points")  # a ray.data.Dataset of the pinned version
    loader = train_loader("spiral:data/points", batch_size=256)  # inside a Ray Train loop

``train_loader`` gives each Ray Train worker its rank's resumable loader, and
``save_loader_state`` / ``restore_loader_state`` keep every rank's position in the checkpoints
the workers report. Needs the ``ray`` extra.
"""

from ray_adapter import TableDatasource, read_table, restore_loader_state, save_loader_state, state_file, train_loader

__all__ = [
    "TableDatasource",
    "read_table",
    "restore_loader_state",
    "save_loader_state",
    "state_file",
    "train_loader",
]
