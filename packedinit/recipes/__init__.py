"""torch's and the model library's own init, per block; materialising.

reset (reset_parameters), replays (torch's defaults replayed through the engine), recurrent
(init_recurrent_), coverage (the meta dry run that sees every write), construction (deferred()),
torch_defaults and init_calls (the process-wide fix, including init calls made by code packedinit
does not own).
"""
