"""The contract layer, at the bottom of the library: what a call is and how it is checked.

- :mod:`.options`: :class:`HeadOptions` and :class:`SamplerOptions`, every option of a head
  call declared once (the module forms and the integrations store these).
- :mod:`.head`: :class:`HeadCall`, the checked call (tensors flattened to rows and every
  option, resolved), built by :func:`check_head_call`, the one check of a head call.
- :mod:`.replay`: :class:`ReplayArgs`, the checked sampler of a call (sampling replay).
- :mod:`.backend`: the backend registry and the rule that picks one.
- :mod:`.sampling`: :class:`SamplingMask`, the engine's kept sets (public as
  ``logitless.SamplingMask``); :mod:`.vocab`: :class:`VocabParallel`, which rows of the
  vocabulary a rank's head holds (public as ``logitless.VocabParallel``).
- :mod:`.checks`: the argument-check primitives (each rule once); :mod:`.collectives`: the one
  "fail together" protocol of collective calls, with ``check_then_agree``.

Kernels import the types of this layer, never its checks; this layer imports nothing of
logitless but :mod:`logitless.transform` (torch only). Import from the submodules: this face
imports none of them.
"""
