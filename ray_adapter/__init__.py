"""ray_adapter: Ray Data and Ray Train on the same work lists as the torch path.

The Ray Data source and Ray Train loaders land with their own issue; the package exists so that
its public names have one home from the start.
"""

__all__: list[str] = []
