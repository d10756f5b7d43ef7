"""The experiment runner's parts (:mod:`.pipeline` orchestrates them for ``python -m kvquant.run``; none measures a
value itself).

- :mod:`.pipeline` a run from its arguments to its exit code; :mod:`.preflight` every check before the model loads
  and the plan of the run's steps; :mod:`.judging` the sequential looks and the gate's decision over the results
- :mod:`.config` the YAML schema as validated frozen dataclasses (:mod:`.gate_config` its ``gate:`` section);
  :mod:`.binding` binds a mapping to them, :mod:`.overrides` applies ``--set``
- :mod:`.results` what a run measures and decides, typed; :mod:`.gate` the accuracy gate (pure functions)
- :mod:`.search` per-layer bit allocation under the gate; :mod:`.store` partial results and the run's lock
- :mod:`.report` results.json, results.csv and the report folder; :mod:`.report_facts`, :mod:`.report_markdown`,
  :mod:`.report_plots` what ``report.md`` and the plots state, rendered from the typed results
"""
