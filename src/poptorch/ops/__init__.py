"""PopTorch's "helper" operations for use inside a model (``poptorch.ops``).

Every op also runs in a plain PyTorch program (outside an executor). The ops that only
carry IPU planning hints (``set_available_memory``, ``set_overlap_for_input``,
``set_overlap_for_output``, ``MultiConv`` settings) record their arguments and return
their input; see ``docs/ops.md``.
"""
# ruff: noqa: F401
from ..annotations.blocks import (
                         BeginBlock,
                         Block,
                         BlockFunction,
                         LegacyBeginBlockFn,
                         recomputationCheckpoint,
                         removeBlocks,
)
from . import registered as _registered  # torch.ops.poptorch.* (upstream op names)
from .cluster import fps, nearest
from .control import cond, for_loop
from .ctc import ctc_beam_search_decoder
from .custom import ATTR_PREFIX, accessAttributes, attributes_lists, custom_op
from .hints import (
                         recorded_hints,
                         set_available_memory,
                         set_overlap_for_input,
                         set_overlap_for_output,
)
from .host import CPU, getIpuTensorId
from .print_tensor import ipu_print_tensor
from .scopes import MultiConv, NameScope
from .tensor import dynamic_slice, dynamic_update, identity_loss, nop, serializedMatMul

__all__ = [
                         "CPU",
                         "BeginBlock",
                         "Block",
                         "BlockFunction",
                         "LegacyBeginBlockFn",
                         "MultiConv",
                         "NameScope",
                         "attributes_lists",
                         "cond",
                         "ctc_beam_search_decoder",
                         "custom_op",
                         "dynamic_slice",
                         "dynamic_update",
                         "for_loop",
                         "fps",
                         "identity_loss",
                         "ipu_print_tensor",
                         "nearest",
                         "nop",
                         "recomputationCheckpoint",
                         "removeBlocks",
                         "serializedMatMul",
                         "set_available_memory",
                         "set_overlap_for_input",
                         "set_overlap_for_output",
]
