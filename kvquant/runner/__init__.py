"""The experiment runner's parts (``python -m kvquant.run`` orchestrates them; none measures a value itself). What a
run is asked and the types its results are kept in are :mod:`kvquant.experiment`'s.

- :mod:`.gate` the accuracy gate (pure functions)
- :mod:`.search` per-layer bit allocation under the gate; :mod:`.store` partial results and the run's lock
- :mod:`.report` results.json, results.csv and the report folder; :mod:`.report_facts`, :mod:`.report_markdown`,
  :mod:`.report_plots` what ``report.md`` and the plots state, rendered from the typed results
"""
