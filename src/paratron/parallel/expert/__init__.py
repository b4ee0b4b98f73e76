"""Expert parallelism: each rank holds E / EP of every MoE layer's experts, and tokens travel to
the ranks that hold their experts (`dispatch.py`, over `comm.py`); `apply.py` makes the twin
layers (also for experts under tensor parallelism)."""
