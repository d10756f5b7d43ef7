"""The only modules of kvquant that touch a dependency's private symbols: one module per dependency
(:mod:`.transformers`, :mod:`.lm_eval`), one small function per private use. Each function's docstring names the
private symbol it wraps and the versions it was checked against; tests/test_compat.py fails when a symbol changes
(it checks the symbol and the function's value on a real object), and a test there refuses these names anywhere
else in kvquant. Checked against transformers 5.25.0 and lm-eval 0.4.13 (Python 3.11's argparse).

transformers (:mod:`kvquant.compat.transformers`):

- :func:`~.transformers.attn_implementation`: ``PretrainedConfig._attn_implementation``
- :func:`~.transformers.recording_attentions`: ``transformers.utils.output_capturing._active_collector``
- :func:`~.transformers.tensor_parallel_size`: ``PreTrainedModel._tp_size``
- :func:`~.transformers.quantized_tensors`: ``BaseQuantizedLayer._quantized_keys`` / ``_quantized_values``

The model's RoPE as a pre-RoPE cache reads it (:mod:`kvquant.compat.rope`; public attributes, kept here because
they are transformers' modelling internals): ``model.get_decoder().rotary_emb`` and its ``forward(x, position_ids[,
layer_type])``, ``config.rope_parameters``, ``config.layer_types``, and the families whose attention rotates keys by
``rotate_half`` over the whole head.

lm-eval (:mod:`kvquant.compat.lm_eval`):

- :func:`~.lm_eval.yaml_base_loader`: ``lm_eval.tasks._yaml_loader._Base``
- :func:`~.lm_eval.run_parser`: ``lm_eval._cli.harness.HarnessCLI()._subparsers``
- :func:`~.lm_eval.parser_actions`: argparse's ``ArgumentParser._actions`` (of lm-eval's ``run`` parser)
- :func:`~.lm_eval.int_or_none_list`: ``lm_eval._cli.utils._int_or_none_list_arg_type``
- :func:`~.lm_eval.set_rank`: ``LM._rank`` / ``LM._world_size``
- :func:`~.lm_eval.quiet_git`: ``lm_eval.evaluator.get_git_commit_hash``, ``lm_eval.loggers.utils.get_commit_from_path``

Not wrapped, because they are the contract itself: ``KVQuantLM`` (kvquant/scoring/lm_eval_model.py) implements
``TemplateLM._loglikelihood_tokens``, the abstract method lm-eval calls (tests/test_compat.py checks it is still
abstract there).
"""
