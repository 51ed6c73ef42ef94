"""The forward tracer: layouts found from how a model's forward splits each weight (infer_layouts).
"""
