"""hybridep: MoE expert-parallel dispatch and combine from PyTorch.

Pure Python over the C library (libhybridep.so, through ctypes): one package for every
torch version. `Buffer` is one EP group over a torch.distributed group; `autograd` pairs
dispatch and combine as each other's backward; `compat.HybridEPBuffer` takes HybridEP's
constructor and call signatures."""
from ._lib import HybridEPError, HybridEPWarning, path as library_path
from .buffer import Buffer, Handle, PermuteHandle, ThreadWorld

__all__ = ["Buffer", "Handle", "PermuteHandle", "ThreadWorld", "HybridEPError",
           "HybridEPWarning", "library_path"]
__version__ = "0.1.0"
