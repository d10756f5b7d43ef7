"""The experiment runner's parts (:mod:`.pipeline` orchestrates them for ``python -m kvquant.run``; none measures a
value itself). What a run is asked and the types its results are kept in are :mod:`kvquant.experiment`'s.

- :mod:`.pipeline` a run from its arguments to its exit code; :mod:`.preflight` every check before the model loads
  and the plan of the run's steps; :mod:`.judging` the sequential looks and the gate's decision over the results
- :mod:`.gate` the accuracy gate (pure functions)
- :mod:`.search` per-layer bit allocation under the gate; :mod:`.store` partial results and the run's lock
- :mod:`.report` results.json, results.csv and the report folder; :mod:`.report_facts`, :mod:`.report_markdown`,
  :mod:`.report_plots` what ``report.md`` and the plots state, rendered from the typed results
"""
