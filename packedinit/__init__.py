"""packedinit: correct torch.nn.init for packed parameters (fused QKV, LSTM gates, MoE experts).

Every fan-dependent ``torch.nn.init`` function reads the shape it is handed; handed a
packed tensor it computes the wrong fans. packedinit hands each logical block to the
init function on its own.
"""

from __future__ import annotations

import importlib

from packedinit.adapters import register_builtins as _register_builtins
from packedinit.adapters.fused import fused_gate_up, fused_qkv
from packedinit.api import ChunkedInit, chunked, chunked_init
from packedinit.auditing.fingerprint import Fingerprint, fingerprint
from packedinit.auditing.measure import AuditReport, BlockAudit, ParamAudit, Reference, audit
from packedinit.engine.chunks import Chunks, logical_blocks
from packedinit.engine.plan import InitFn, InitSpec
from packedinit.errors import (
    LayoutWarning,
    PackedInitError,
    PackedInitNotImplementedError,
    PackedInitRuntimeError,
    PackedInitTypeError,
)
from packedinit.layout import Layout, LogicalBlock
from packedinit.model import found as _found
from packedinit.model import registry as _registry
from packedinit.model.claims import annotate, layouts
from packedinit.model.registry import Adapter, register, registered, unregister
from packedinit.model.ties import to_empty
from packedinit.model.walk import init_model
from packedinit.recipes.construction import deferred
from packedinit.recipes.recurrent import init_recurrent_
from packedinit.recipes.reset import reset_parameters
from packedinit.recipes.torch_defaults import fix_torch_defaults
from packedinit.trace.auto import trace_model as _trace_model
from packedinit.trace.compare import same_blocks as _same_blocks
from packedinit.trace.forward import Inferred, infer_layouts

_registry.set_builtin_loader(_register_builtins)  # built-in adapters register on the registry's first use
_found.set_tracer(_trace_model, _same_blocks)  # the whole-model idioms read layouts from the forward too
# ``packedinit.audit`` is the module of that name, callable as the audit function (see packedinit/audit.py):
# ``packedinit.audit(model)`` and ``packedinit.audit.DEFAULT_REFERENCES`` both work.
importlib.import_module("packedinit.audit")

__version__ = "0.1.0"

__all__ = [
    # layout and engine
    "Layout",
    "LogicalBlock",
    "Chunks",
    "InitFn",
    "InitSpec",
    "ChunkedInit",
    "PackedInitError",
    "LayoutWarning",
    "chunked",
    "chunked_init",
    "logical_blocks",
    # registry and whole-model init
    "Adapter",
    "register",
    "unregister",
    "registered",
    "annotate",
    "layouts",
    "fused_qkv",
    "fused_gate_up",
    "init_model",
    "reset_parameters",
    "to_empty",
    "deferred",
    "init_recurrent_",
    "fix_torch_defaults",
    # the forward tracer
    "infer_layouts",
    "Inferred",
    # audit
    "audit",
    "AuditReport",
    "ParamAudit",
    "BlockAudit",
    "Reference",
    # error types (each also a PackedInitError)
    "PackedInitTypeError",
    "PackedInitRuntimeError",
    "PackedInitNotImplementedError",
    # fingerprint
    "fingerprint",
    "Fingerprint",
]
