"""Several processes and hosts: ``cluster`` (TF_CONFIG and Slurm), the
engines ``collective``, ``sharded`` and ``ingraph`` (TensorFlow's in-graph
replication), ``wire`` (what the collective engines send), ``heartbeat``,
``launch`` (``python -m gradaccum.launch``), ``membership`` (elastic jobs) and
``consolidate`` (``python -m gradaccum.consolidate``), with ``layout``, the
checkpoint directories they share. Public names are re-exported by
:mod:`gradaccum`.
"""
