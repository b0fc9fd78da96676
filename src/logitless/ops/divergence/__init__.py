"""The divergence to a teacher head (distillation): :func:`~logitless.linear_divergence`
(``op.py``), its autograd function (``function.py``) and the naive full-logits version
(``naive.py``). Its kernels live with the log-prob op's, in the backends, and are found the same
way (the registry, ``contract/backend.py``; ``backends.divergence_backend_for``): the torch
tiles in ``backends/torch_divergence.py`` (the sparse teacher's part in
``torch_divergence_topk.py``), the Triton kernels in ``backends/triton_divergence.py``, both
implementing ``backends.base.DivergenceBackend`` on the types they share (``DivRows``,
``DivOptions``, ``DivStats``, ``DivUpstream``)."""
