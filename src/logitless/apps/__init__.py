"""Applications built on the library: ``logitless bench`` (:mod:`.bench`), ``logitless demo``
(:mod:`.demo`), the command line that runs them (:mod:`.cli`), the peak-memory meters both
measure with (:mod:`.memory`) and what both write through (:mod:`.output`: CSV files, figures,
a status line).

The library never imports this package (``import logitless`` loads none of it), and nothing is
imported here, so ``python -m logitless.apps.bench.worker`` runs the worker fresh as
``__main__``.
"""
