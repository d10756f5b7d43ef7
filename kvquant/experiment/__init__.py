"""The experiment's vocabulary, below both :mod:`kvquant.scoring` (which measures) and :mod:`kvquant.runner` (which
orchestrates, judges and reports): what a run is asked to measure and in what terms its results are kept. Neither
package above is imported from here.

- :mod:`.config` the YAML schema as validated frozen dataclasses, with its sections :mod:`.model_config`
  (``model:``), :mod:`.gate_config` (``gate:``, and the sequential looks: how many documents each look scores) and
  :mod:`.long_config` (``eval.long_context``, needle task names); :mod:`.binding` binds a mapping to them and applies
  ``--set``
- :mod:`.results` what a run measures and decides, typed; :mod:`.metric` the kinds of metric (kind, direction,
  threshold, interval, minimum count, rendering)
- :mod:`.provenance` the measuring sources, their digest and the code version every result is keyed by

Its code decides measured values (a candidate's cache setting, the documents each look scores, which task names
are needle tasks), so it is among the hashed measuring sources (:data:`.provenance.MEASURING`).
"""
