"""kvquant and the engines around it: what a decided setting is started with (:mod:`.deploy`,
:mod:`.deploy_llamacpp`, :mod:`.deploy_read` for ``python -m kvquant.export``), and llama.cpp itself in the loop
(:mod:`.llamacpp_engine`, :mod:`.llamacpp_compare`)."""
