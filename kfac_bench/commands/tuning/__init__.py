"""The parts of ``kfac-bench tune`` (:mod:`kfac_bench.commands.tune`): how a grid is ranked and shown
(:mod:`.rank`) and what the tune writes outside its runs (:mod:`.files`)."""
