"""Batch-invariant forward ops: a row's result depends on that row's values only, never on how many other rows share
the call, where the row sits, prefill vs decode, or the thread split. ``miles.model.kernels.INVARIANT`` routes the
decoder, the engine's prefill and decode steps and the trainer's log-probs through ``miles.invariant.ops``, so the
engine's log-prob of every sampled token equals the trainer's bit for bit (``true_on_policy``). CPU: ``cpu`` over the
exact building blocks of ``exact``; CUDA: the Triton kernels of ``gpu``; rotary tables: ``rope``."""
