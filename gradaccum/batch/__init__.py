"""What sets k, the number of micro-batches per update: ``schedules``
(:func:`gradaccum.step_schedule`, :func:`gradaccum.batch_ramp`), ``adaptive``
(:class:`gradaccum.AdaptiveBatch`) and ``finder``
(:func:`gradaccum.find_micro_batch`). Public names are re-exported by
:mod:`gradaccum`.
"""
