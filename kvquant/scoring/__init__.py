"""Scoring through a quantized cache: every number a run measures comes from here (measuring code, hashed whole).

- :mod:`.scorer` log-likelihoods with attention reading the quantized K/V (simulated and streaming modes)
- :mod:`.session` what a run measures: the baseline and each candidate's perplexity, divergence, tasks and memory
- :mod:`.data` perplexity text as token windows; :mod:`.tasks`, :mod:`.task_rows` the offline lm-eval tasks;
  :mod:`.fewshot` few-shot contexts that fit; :mod:`.passkey` the long-range pass-key probe; :mod:`.needles`
  retrieval documents by length and depth
- :mod:`.models` loading models and tokenizers; :mod:`.lm_eval_model` lm-eval's ``kvquant`` model
- :mod:`.calibrate` the calibration split (what calibration reads) and static scales observed on it;
  :mod:`.stages` the staged memory loop; :mod:`.parallel` the share of a data-parallel run's work each process measures
"""
