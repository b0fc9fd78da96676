"""One folder per op, each holding its public entry, autograd function and naive piece side by
side (the flash-linear-attention layout):

- :mod:`.logprobs`: :func:`~logitless.linear_logprobs` (``op.py``), its autograd function
  (``function.py``), its ``torch.compile`` custom op (``compiled.py``) and the naive full-logits
  version (``naive.py``).
- :mod:`.replay`: sampling replay (``op.py``: plan, forward, backward), the kept sets of the
  truncated rows (``sets.py``), the kept-entry kernels (``kept.py``), the streaming top-k
  (``topk_stream.py``) and the naive masked log-softmax (``naive.py``).
- :mod:`.fused_loss`: :func:`~logitless.fused_policy_loss` (``op.py``), the typed interface to
  a loss (``row_loss.py``) and the replay schedule (``replay.py``).

:mod:`.rows` is what every op does first (the valid rows of a checked call, the kernels'
options). The kernels themselves are backends (:mod:`logitless.backends`); the checks are the
contract's (:mod:`logitless.contract`); :mod:`logitless.reference` is built from the naive
pieces.
"""
