"""Test setup: Triton kernels run under the CPU interpreter when no CUDA device is present."""

import os
import shutil

if not shutil.which("nvidia-smi") and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
