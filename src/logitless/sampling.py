"""What a truncating sampler kept (:class:`SamplingMask`): the public home of the type, defined
with the call's other types in :mod:`logitless.contract.sampling`."""

from .contract.sampling import SamplingMask

__all__ = ["SamplingMask"]
