"""``kfac-bench plan``: what a recipe's K-FAC costs per GPU at N GPUs, from layer shapes and engine rules.

:mod:`.config` (the ``plan.*`` keys) → :mod:`.recipe` (the full-size model on the meta device, the engine's
scan and settings) → :mod:`.costs` (per-rank memory, traffic and decomposition load of one world size ×
fraction × placement × factor reduction, with the engine's ``assign`` and ``make_buckets``) → :mod:`.timing`
and :mod:`.profile` (seconds per stage) → :mod:`.report` and :mod:`.plot` (``plan.json``, the table,
``plan.png``); :mod:`.reference` sets KAISA Table 5 beside the reference code's layout;
:mod:`.time_to_solution` projects the minutes to the end of training per world size and arm, with a band,
from a profile (:mod:`.stage_profile`, read by :mod:`.safe_yaml`), the cluster it names (:mod:`.cluster`,
derived by :mod:`.calibrate`), the network model (:mod:`.network`) and the arms' recipes (:mod:`.length`);
:mod:`.tts_render` prints it. It imports the engine, configs, data and models, never the training loop.
"""
