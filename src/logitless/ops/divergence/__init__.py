"""The divergence to a teacher head (distillation): :func:`~logitless.linear_divergence`
(``op.py``), its autograd function (``function.py``), the torch tiles (``tiles.py``), the
sparse teacher's part of them (``topk.py``) and the naive full-logits version (``naive.py``)."""
