"""Bundled examples: the naive code a user writes, which ``autoopt demo`` runs and measures.

Each module has the user's function under plain ``@jax.jit`` (what ``autoopt explain`` and
``autoopt rewrite`` analyse), ``make_args()`` (example arguments, for ``--args``) and
``run(step, steps)`` (the user's loop, given the jitted step to call), and the hand-written
expert version: ``expert_step`` (run by the same loop), or ``run_expert(steps)`` with
``expert_args()`` where the expert restructures the inputs. Installed as
``autoopt.examples``; in a source checkout they are ``examples/*.py``, so
``autoopt explain examples/row_updates.py:write_row --args examples/row_updates.py:make_args``
works from the repository root.
"""

# module -> the user's jitted function in it
EXAMPLES = {
    "row_updates": "write_row",
    "train_step": "train_step",
    "transformer": "train_step",
    "host_feed": "sgd_step",
}
