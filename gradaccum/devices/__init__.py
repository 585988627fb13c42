"""One model function on devices, in two forms: ``tower`` (one run per
micro-batch, or per batch without accumulation) and ``subdivisions`` (one run
per update, the micro-batches in a loop inside the graph), with what they
share: ``placement`` of devices and variables, ``model`` (what a model
function returns, its scopes and update ops), ``splitting`` (a batch cut into
shards), ``context`` (what synchronized layers see), ``guard`` (no model on an
empty shard) and ``batch_norm``. Public names are re-exported by :mod:`gradaccum`.
"""
