"""One tensor: a request -> a checked, cached Plan -> one executor writing blocks through a sink.

chunks and traits (what is known about each init function), keys (cache keys from a request's
fields), plan, execute (the block loop, LocalSink), lean (the one lean-path decision), orient
(transposed storage), run (the entry), distributed (DTensor shards), rng (the one RNG lock).
The engine never imports model, recipes, auditing or cli.
"""
