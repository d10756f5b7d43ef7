"""The experiment's vocabulary, below both ``kvquant.scoring`` and ``kvquant.runner``."""
