"""Kernel tests run the Triton kernels compiled on a GPU, or through Triton's interpreter on CPU (CI).

TRITON_INTERPRET must be in the environment before @triton.jit decorates the kernels, i.e. before
kernels.attention.triton_paged is first imported, so it is set here at conftest import time (collection), and only
without CUDA: on a GPU machine the same tests check the compiled kernels, and the rest of the session (engine tests)
keeps compiled Triton. If something imported the module earlier in compiled mode, it is reloaded.
"""

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "tokenweir.kernels.attention.triton_paged" in sys.modules:
        importlib.reload(sys.modules["tokenweir.kernels.attention.triton_paged"])
