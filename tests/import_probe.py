"""A module that records, in the file ``$IMPORT_PROBE``, the process id of every process that
imports it: which processes paid for an import."""

import os

with open(os.environ["IMPORT_PROBE"], "a") as probe:
    probe.write(f"{os.getpid()}\n")
