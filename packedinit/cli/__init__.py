"""The command line (``python -m packedinit``): parse (targets, values, inits) and command (main).
"""
