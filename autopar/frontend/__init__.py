"""The front end: from the user's step to the programs the rest compiles.

Takes: the user's ``train_step`` and its arguments. Gives: the step traced
to a jaxpr (``trace.py``, ``pytrees.py``, ``retype.py``: arguments as
leaves, symbolic batch sizes) and split at the gradient marker
(``marker.py``) into ``compute_grad`` and ``apply_grad`` (``split.py``),
with what the rest needs to know about it: which dimensions hold the
batch's rows (``rows.py``), how each output combines over micro-batches
(``combine.py``), the loss's gradient as the whole batch's (``loss.py``),
random draws per row (``rng.py``), the user's sharding hints
(``hints.py``), repeated layers checkpointed one by one (``remat.py``)
and the stacked gradients a scan makes (``gradstack.py``), a jaxpr
interpreter under pins (``evaluate.py``), the loss function captured as
one call (``capture.py``), and for pipelines the step traced for one
(``pipeline.py``), its forward program ``P`` (``program.py``), the stages
cut out of it (``cut.py``, ``stages.py``) and the update cut per stage
(``apply_segments.py``).

Imports only the shared leaves (errors, jax_compat, version, text, disk).
"""
