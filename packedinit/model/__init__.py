"""Who is packed, and the whole-model walk.

registry (adapters by class), marks and claims (annotations, what adapters say), wrappers and
parametrized (names through peft/compile/DDP/FSDP wrappers and parametrizations), ties (shared
Parameters across to_empty), walk (init_model, chunked(f)(model), model.apply).
Never imports recipes, auditing or cli.
"""
