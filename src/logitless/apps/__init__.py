"""Applications built on the library: ``logitless bench`` (:mod:`.bench`), ``logitless demo``
(:mod:`.demo`), the command line that runs them (:mod:`.cli`), the peak-memory meters both
measure with (:mod:`.memory`), what both write through (:mod:`.output`: CSV files, figures,
a status line) and the ahead-of-time compile check of the Triton kernels (:mod:`.aot`,
``python -m logitless.apps.aot --report``).

The library never imports this package (``import logitless`` loads none of it), and nothing is
imported here, so ``python -m logitless.apps.bench.worker`` runs the worker fresh as
``__main__``.
"""
