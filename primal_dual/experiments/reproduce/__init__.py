"""The paper-reproduction grids, one module per task (``uea``, ``listops``, ``images``, ``sraven``,
``logic``), each with ``main(argv) -> exit status``: ``primal-dual reproduce <task>`` and the thin
``scripts/reproduce_<task>.py`` run them."""
