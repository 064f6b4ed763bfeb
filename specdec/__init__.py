"""SpecServe core: exact speculative decoding in one process (no Ray, no HTTP).

The pieces here are reused unchanged by the distributed pipeline in ``deployments/``:
sampling transforms (:mod:`specdec.sampling`), the rejection sampler
(:mod:`specdec.rejection`), model runners with a slot KV cache (:mod:`specdec.runner`),
proposers (:mod:`specdec.proposers`), the reference loops (:mod:`specdec.generate`) and
the speedup/goodput model (:mod:`specdec.speedup`).
"""

from specdec.sampling import SamplingParams

__all__ = ["SamplingParams"]
