"""The capacity planner's parts (``python -m kvquant.plan``): :mod:`.shapes` model shapes and their bounds,
:mod:`.cost` the byte arithmetic of a cache setting for any number of tokens."""
