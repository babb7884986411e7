"""Disk-delta weight sync (``sync.transport = "disk-delta"``): the trainer writes zstd-compressed byte deltas of its
weights into a shared directory and the engines pull each published version.

``transport`` the DiskDeltaSync transport and its config; ``codec`` per-tensor XOR / sparse XOR / overwrite deltas;
``version`` one published version on disk and how an engine applies it; ``baseline`` the checkpoint the first delta
is taken against; ``safetensors_dtypes`` the dtype table and an offset-keeping header reader; ``staging_pool``
bounded host buffers for device-to-host copies; ``collective_errors`` hold-then-gather errors across ranks.
"""
