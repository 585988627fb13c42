"""The window: k micro-batches' gradients summed, normalised and applied once.

``accumulator`` (:class:`GradientAccumulator`, the fused train op), ``pipeline``
(the window's end: sum, reduce, divide, skip, clip, apply, count, notify,
reset), its two protocols ``reducers`` and ``observers``, its ``state``
variables, ``access`` (what a built window answers), ``statistics`` (the
gradient noise scale) and ``summaries``. Nothing here imports from the other
subpackages. Public names are re-exported by :mod:`gradaccum`.
"""
