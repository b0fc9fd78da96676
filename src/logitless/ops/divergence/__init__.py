"""The divergence to a teacher head (distillation): :func:`~logitless.linear_divergence`
(``op.py``), its autograd function (``function.py``), the torch tiles (``tiles.py``), the
sparse teacher's part of them (``topk.py``) and the naive full-logits version (``naive.py``).
Its Triton kernels live with the log-prob op's, in ``backends/triton_divergence.py``; the
types both implementations share (``DivRows``, ``DivOptions``, ``DivStats``, ``DivUpstream``)
in ``backends/base.py``."""
