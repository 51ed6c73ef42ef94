"""packedinit: correct torch.nn.init for packed parameters (fused QKV, LSTM gates, MoE experts).

Every fan-dependent ``torch.nn.init`` function reads the shape it is handed; handed a
packed tensor it computes the wrong fans. packedinit hands each logical block to the
init function on its own.
"""

from __future__ import annotations

from . import registry as _registry
from .adapters import register_builtins as _register_builtins
from .adapters.fused import fused_gate_up, fused_qkv
from .api import ChunkedInit, chunked, chunked_init
from .audit import AuditReport, BlockAudit, ParamAudit, Reference, audit
from .chunks import Chunks, logical_blocks
from .claims import annotate, layouts
from .construction import deferred
from .errors import PackedInitError
from .layout import Layout, LogicalBlock
from .plan import InitFn, InitSpec
from .recipes import init_recurrent_, reset_parameters
from .registry import Adapter, register, registered, unregister
from .ties import to_empty
from .torch_defaults import fix_torch_defaults
from .trace import Inferred, infer_layouts
from .walk import init_model

_registry.set_builtin_loader(_register_builtins)  # built-in adapters register on the registry's first use

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
]
