"""The experiment runner's parts (``python -m kvquant.run`` orchestrates them; none measures a value itself).

- :mod:`.config` the YAML schema as validated frozen dataclasses (:mod:`.gate_config` its ``gate:`` section);
  :mod:`.binding` binds a mapping to them, :mod:`.overrides` applies ``--set``
- :mod:`.results` what a run measures and decides, typed; :mod:`.gate` the accuracy gate (pure functions)
- :mod:`.search` per-layer bit allocation under the gate; :mod:`.store` partial results and the run's lock
- :mod:`.report` results.json, results.csv and the report folder; :mod:`.report_facts`, :mod:`.report_markdown`,
  :mod:`.report_plots` what ``report.md`` and the plots state, rendered from the typed results
"""
