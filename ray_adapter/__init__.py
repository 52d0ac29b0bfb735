"""ray_adapter: Ray Data and Ray Train on the same work lists as the torch path.

``TableDatasource`` / ``read_table`` read a table version into Ray Data, one read task per run of
a policy's work items; ``train_loader`` gives each Ray Train worker its rank's resumable loader,
and ``save_loader_state`` / ``restore_loader_state`` keep every rank's position in the checkpoints
the workers report.
"""

from ray_adapter.datasource import TableDatasource, read_table
from ray_adapter.files import state_file
from ray_adapter.train import restore_loader_state, save_loader_state, train_loader

__all__ = [
    "TableDatasource",
    "read_table",
    "restore_loader_state",
    "save_loader_state",
    "state_file",
    "train_loader",
]
