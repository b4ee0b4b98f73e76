"""Context parallelism: every sequence is split over CP ranks, each holding two of 2CP chunks
(i and 2CP - 1 - i, which balances causal attention: `split.py`); attention reaches the other
ranks' keys and values by a ring or an all-gather (`attention.py`, over `comm.py`, with the
per-block kernels of `kernels.py`); `apply.py` swaps the model's attention cores."""
