"""The contract layer, at the bottom of the library: what a call is and how it is checked.

- :mod:`.options`: :class:`HeadOptions` and :class:`SamplerOptions`, every option of a head
  call declared once (the module forms and the integrations store these).
- :mod:`.head`: :class:`HeadCall`, the checked call (tensors flattened to rows and every
  option, resolved), built by :func:`check_head_call`, the one check of a head call.
- :mod:`.replay`: :class:`ReplayArgs`, the checked sampler of a call (sampling replay).
- :mod:`.backend`: the backend registry and the rule that picks one.
- :mod:`.checks`: the argument-check primitives (each rule once); :mod:`.agree`: the one
  "check, then agree across ranks" rule of collective calls.

Kernels import the types of this layer, never its checks; this layer imports nothing above it
(only :mod:`logitless.parallel`'s ``VocabParallel`` type, :mod:`logitless.sampling` and
:mod:`logitless.transform`). Import from the submodules: this face imports none of them, so
the bottom modules (:mod:`logitless.sampling`, :mod:`logitless.parallel`) can use
:mod:`.checks` without a cycle.
"""
